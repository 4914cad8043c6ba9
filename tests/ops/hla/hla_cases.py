"""Shared inputs of the HLA test files."""

from polyattn.testing import seeded_inputs

VARIANTS = {"hla2": (2, False), "ahla": (2, True), "hla3": (3, False)}


def hla_inputs(B, T, H, K, V, *, decay, normalize, seed):
    """float64 ``q, k, v, g`` (g None without decay); q, k >= 0 when normalized (ops/hla/README.md)."""
    x = seeded_inputs(B, T, H, K, V, decay=decay, seed=seed)
    x.pop("beta")
    if normalize:
        x["q"], x["k"] = x["q"].abs(), x["k"].abs()
    return x


def variant_kwargs(name, normalize, scale):
    order, asymmetric = VARIANTS[name]
    return dict(order=order, asymmetric=asymmetric, normalize=normalize, scale=scale)
