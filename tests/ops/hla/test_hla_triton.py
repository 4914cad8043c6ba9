"""`ops.hla(..., impl="triton")` (HLA composed from the Triton linear_attn) against the float64 naive.

fp32 inputs: within 2x the chunk form's error (plus the fp32 rounding floor of test_triton.py).
bf16 inputs: the Triton composition keeps Y/Z in bf16 (documented in ops/hla/triton), so the
bound is a hard ceiling of 3e-2 relative rather than 2x the fp32-intermediate chunk form.
"""
from __future__ import annotations

import pytest
import torch

from polyattn import ops
from polyattn.ops.hla import hla_chunk, hla_naive
from polyattn.testing import rel_err, seeded_inputs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
B, H, K, V = (2, 4, 64, 48) if CUDA else (1, 2, 8, 6)
VARIANTS = {"hla2": dict(order=2), "ahla": dict(order=2, asymmetric=True), "hla3": dict(order=3),
            "hla2-norm": dict(order=2, normalize=True)}


def _grads(form, x, options, *, cu_seqlens=None):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    kwargs = dict(scale=K ** -0.5, output_final_state=True, **options)
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = cu_seqlens
    o, state = form(leaves["q"], leaves["k"], leaves["v"], leaves["g"], **kwargs)
    gen = torch.Generator().manual_seed(9)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(DEVICE)).sum()
    loss = loss + sum((f.double() * torch.randn(f.shape, generator=gen, dtype=torch.float64).to(DEVICE)).sum() for f in state)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"o": o, **{f"state.{i}": f for i, f in enumerate(state)}, **{f"d{n}": d for n, d in zip(leaves, grads)}}


def _inputs(T, dtype, positive):
    x = seeded_inputs(B, T, H, K, V, decay=True, seed=11, device=DEVICE)
    x.pop("beta")
    if positive:  # normalized HLA needs nonnegative features (ops/hla/README.md, "Normalized variant")
        x["q"], x["k"] = x["q"].abs(), x["k"].abs()
    return {n: t.to(dtype) for n, t in x.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [2, 65])  # at T = 1 with no initial state the exact dg is 0
def test_hla_triton_matches_naive(T, dtype, variant):
    options = VARIANTS[variant]
    x = _inputs(T, dtype, positive=options.get("normalize", False))
    exact = {n: t.double() for n, t in x.items()}
    ref = _grads(hla_naive, exact, options)
    base = _grads(hla_chunk, x, options)
    got = _grads(lambda *a, **kw: ops.hla(*a, impl="triton", **kw), x, options)
    for name, expected in ref.items():
        err, err_chunk = rel_err(got[name], expected), rel_err(base[name], expected)
        bound = max(2 * err_chunk, 5e-6) if dtype == torch.float32 else 3e-2
        assert err <= bound, f"{variant} {name}: triton rel err {err:.2e} > {bound:.2e} (chunk {err_chunk:.2e})"


def test_hla_triton_varlen():
    lengths = [5, 64, 20]
    x = _inputs(sum(lengths), torch.float32, positive=False)
    x = {n: t[:1] for n, t in x.items()}
    cu = torch.tensor([0, 5, 69, 89], device=DEVICE)
    o, state = ops.hla(x["q"], x["k"], x["v"], x["g"], cu_seqlens=cu, output_final_state=True, impl="triton")
    o_ref, state_ref = ops.hla(x["q"].double(), x["k"].double(), x["v"].double(), x["g"].double(),
                               cu_seqlens=cu, output_final_state=True, impl="naive")
    assert rel_err(o, o_ref) <= 5e-6
    for f, f_ref in zip(state, state_ref):
        assert rel_err(f, f_ref) <= 5e-6


@pytest.mark.parametrize("name", ["hla2", "ahla", "hla3"])
def test_inner_decay_mixer_runs_the_kernels_in_the_input_dtype(name, monkeypatch):
    """The HLA mixers' inner-decay calls (their default gate placement) on the Triton form take the bf16
    q, k, v that bf16 autocast gives them, as ops.hla's Triton form does, not fp32 copies (fp32 inputs
    run the kernels' IEEE fp32 products, 18x the linear mixer's training step on the H200); the output
    stays within bf16's rounding of the PyTorch chunk form's."""
    from polyattn.layers import build_mixer

    torch.manual_seed(0)
    mixer = build_mixer(name, 32, num_heads=2, impl="triton").to(DEVICE)
    reference = build_mixer(name, 32, num_heads=2, impl="chunk").to(DEVICE)
    reference.load_state_dict(mixer.state_dict())
    x = torch.randn(2, 70, 32, device=DEVICE)
    seen, real = [], ops.linear_attn
    monkeypatch.setattr(ops, "linear_attn", lambda q, k, v, *a, **kw: seen.append({q.dtype, k.dtype, v.dtype}) or real(q, k, v, *a, **kw))
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y, _ = mixer(x)
        seen_triton, seen[:] = list(seen), []
        y_ref, _ = reference(x)
    assert len(seen_triton) == (3 if name == "hla3" else 2) and all(s == {torch.bfloat16} for s in seen_triton), seen_triton
    assert all(s == {torch.float32} for s in seen), seen  # the chunk form computes in fp32
    assert rel_err(y, y_ref) < 2.0**-7, rel_err(y, y_ref)
