"""Cases for the context-parallel tests: each builds a whole row in float64 (the same on every rank) and
names the op, so a worker can run the single-process op on the row and the context-parallel one on its shard."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyattn import ops
from polyattn.ops.common import num_levels


def row(T, H=2, K=4, V=3, *, positive=False, unit_keys=False, seed=0):
    """Per-token tensors of a packed row ``[1, T, ...]`` in float64."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rand(1, T, H, K), rand(1, T, H, K), rand(1, T, H, V)
    if positive:
        q, k = F.elu(q) + 1, F.elu(k) + 1
    if unit_keys:
        k = F.normalize(k, dim=-1)
    g = -torch.rand(1, T, H, generator=gen, dtype=torch.float64) * 0.2
    beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    lam = torch.rand(1, T, H, num_levels(T), generator=gen, dtype=torch.float64) + 0.5
    return dict(q=q, k=k, v=v, g=g, beta=beta, lam=lam)


# name -> (op name, per-token inputs in call order, keyword options, row options)
CASES = {
    "linear": ("linear_attn", ("q", "k", "v"), {}, {}),
    "linear-decay": ("linear_attn", ("q", "k", "v", "g"), {}, {}),
    "delta": ("delta_rule", ("q", "k", "v", "beta", "g"), {}, {"unit_keys": True}),
    "hla2": ("hla", ("q", "k", "v", "g"), {"order": 2}, {}),
    "hla2-norm": ("hla", ("q", "k", "v", "g"), {"order": 2, "normalize": True}, {"positive": True}),
    "ahla": ("hla", ("q", "k", "v", "g"), {"order": 2, "asymmetric": True}, {}),
    "ahla-norm": ("hla", ("q", "k", "v"), {"order": 2, "asymmetric": True, "normalize": True}, {"positive": True}),
    "hla3": ("hla", ("q", "k", "v", "g"), {"order": 3}, {}),
    "hla3-norm": ("hla", ("q", "k", "v", "g"), {"order": 3, "normalize": True}, {"positive": True}),
    "loglinear-mamba2": ("loglinear_attn", ("q", "k", "v", "lam", "g"), {}, {}),
    "loglinear-gdn": ("loglinear_attn", ("q", "k", "v", "lam", "g"), {"beta": "beta"}, {"unit_keys": True}),
    "loglinear-gdn-scan": ("loglinear_attn", ("q", "k", "v", "lam", "g"), {"beta": "beta", "impl": "scan"}, {"unit_keys": True}),
    "kata-m1": ("kata", ("q", "k", "v", "g"), {}, {}),
    "kata-m2-unnormalized": ("kata", ("q", "k", "v", "g"), {"groups": 2, "normalize": False}, {}),
    "kata-s2": ("kata", ("q", "k", "v"), {"groups": 2, "combine": "sum"}, {}),
    "kata-orthant": ("kata", ("q", "k", "v", "g"), {"feature": "orthant"}, {}),
    "kata-lorentz": ("kata", ("q", "k", "v"), {"feature": "lorentz"}, {}),
    "deltakata": ("kata", ("q", "k", "v", "g"), {"beta": "beta", "normalize": False}, {}),
}


def case_call(name, tensors):
    """``(op name, positional tensors, keyword options)`` of case ``name`` over ``tensors`` (names -> tensors)."""
    op, inputs, options, _ = CASES[name]
    kwargs = {key: tensors[value] if isinstance(value, str) and value in tensors else value for key, value in options.items()}
    return op, [tensors[x] for x in inputs], kwargs


def reference(name, tensors, weights, cu_seqlens):
    """Single-process outputs and the gradients of ``Σ o · weights`` w.r.t. every input tensor of the case."""
    leaves = {key: x.clone().requires_grad_(True) for key, x in tensors.items()}
    op, args, kwargs = case_call(name, leaves)
    o, _ = getattr(ops, op)(*args, **kwargs, cu_seqlens=cu_seqlens)
    (o * weights).sum().backward()
    return o.detach(), {key: x.grad for key, x in leaves.items() if x.grad is not None}
