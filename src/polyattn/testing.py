"""Test helpers: relative errors and seeded inputs (used by the test suite and by benchmarks)."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected| / max |expected|`` in float64 (0 when both are zero)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    err = (a - e).abs().max().item() if a.numel() else 0.0
    ref = e.abs().max().item() if e.numel() else 0.0
    if ref == 0.0:
        return err
    return err / ref


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "") -> None:
    """Assert equal shapes, finite values and ``rel_err(actual, expected) <= rtol``."""
    label = f"{name}: " if name else ""
    assert actual.shape == expected.shape, f"{label}shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert bool(torch.isfinite(actual).all()), f"{label}non-finite values"
    err = rel_err(actual, expected)
    assert err <= rtol, f"{label}relative error {err:.3e} > {rtol:.1e}"


def assert_decay_weights_close(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    """A kernel's log2-decays `got` against direct sums `want` of the same (reset-limited) log-decays,
    compared as the fp32 weights `exp2(.)` the kernels use: equal where either is 0 (a weight across
    a reset), else within 8 fp32 ulps of the largest |want|, the rounding of a difference of two
    in-chunk cumsums."""
    w_got, w_want = torch.exp2(got.float()).cpu(), torch.exp2(want.float()).cpu()
    finite = torch.isfinite(want.cpu())
    tol = 8 * torch.finfo(torch.float32).eps * max(1.0, float(want.cpu()[finite].abs().max())) * math.log(2)
    bad = ~((w_got - w_want).abs() <= w_want * tol + torch.finfo(torch.float32).tiny)
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} weights beyond {tol:.1e} relative, e.g. {w_got[bad][:3].tolist()} vs {w_want[bad][:3].tolist()}"


def seeded_inputs(B, T, H, K, V, *, dtype=torch.float64, decay=True, beta=False, seed=0, device="cpu") -> dict:
    """Deterministic ``q, k, v: [B, T, H, *]``, ``g: [B, T, H]`` in about [-0.3, 0] (or None), ``beta`` in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    out = {"q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, H, V)}
    out["g"] = (-0.3 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)).to(device=device, dtype=dtype) if decay else None
    out["beta"] = torch.sigmoid(randn(B, T, H)).to(dtype) if beta else None
    return out


def _state_fields(state) -> list[torch.Tensor]:
    return [state] if isinstance(state, torch.Tensor) else list(state)


def assert_states_close(actual, expected, rtol: float, name: str = "state") -> None:
    """Compare two states field by field (a tensor, or a NamedTuple of tensors; integer fields exactly)."""
    for i, (a, e) in enumerate(zip(_state_fields(actual), _state_fields(expected), strict=True)):
        if a.dtype.is_floating_point:
            assert_close_rel(a, e, rtol, f"{name}[{i}]")
        else:
            assert torch.equal(a, e), f"{name}[{i}]: {a.tolist()} != {e.tolist()}"


def assert_continuation(op, inputs: dict, split: int, rtol: float, **kwargs) -> None:
    """``op`` over ``[0, T)`` equals ``op`` over ``[0, split)`` then ``[split, T)`` from its final state.

    ``inputs`` holds the per-token tensors (``[B, T, ...]`` or None) passed by keyword; ``kwargs`` the rest.
    """
    first = {n: None if x is None else x[:, :split] for n, x in inputs.items()}
    second = {n: None if x is None else x[:, split:] for n, x in inputs.items()}
    o_full, s_full = op(**inputs, output_final_state=True, **kwargs)
    o_1, s_1 = op(**first, output_final_state=True, **kwargs)
    o_2, s_2 = op(**second, initial_state=s_1, output_final_state=True, **kwargs)
    assert_close_rel(torch.cat([o_1, o_2], dim=1), o_full, rtol, f"output split at {split}")
    assert_states_close(s_2, s_full, rtol, f"final state split at {split}")


def assert_varlen(op, inputs: dict, lengths: list[int], rtol: float, initial_state=None, **kwargs) -> None:
    """``op`` on sequences packed with ``cu_seqlens`` (``inputs`` have B = 1) equals separate runs."""
    from polyattn.ops.common import state_cat, state_index

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int64)
    o, s = op(**inputs, cu_seqlens=cu, initial_state=initial_state, output_final_state=True, **kwargs)
    outs, states = [], []
    for i, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        piece = {n: None if x is None else x[:, bos:eos] for n, x in inputs.items()}
        o_i, s_i = op(**piece, initial_state=state_index(initial_state, i), output_final_state=True, **kwargs)
        outs.append(o_i)
        states.append(s_i)
    assert_close_rel(o, torch.cat(outs, dim=1), rtol, "packed output")
    assert_states_close(s, state_cat(states), rtol, "packed final states")


# Low-precision forms against the float64 spec (the Triton rung of the test ladder).
# Error bound per tensor: rel_err(form) <= min(max(2 * rel_err(chunk), FLOOR), CEILING), where
# `chunk` is the PyTorch chunk form run on the same low-precision inputs. The floors are
# rounding noise: one bf16 ulp (the chunk form rounds once, at the end, so its own error can sit
# anywhere under that), and for fp32 ~40 ulps, which varies case to case by more than 2x (exp
# of a rounded log-decay sum), yet stays 60x under a tf32 product's error.
# A tensor whose float64 reference is under ZERO_TO_ROUNDING of the call's largest reference tensor is
# zero to rounding (a gradient that cancels exactly, as dq of a normalized read of one token, or a
# decay that underflows every low-precision dtype): a relative error compares rounding noise with
# noise there, so its errors are measured on the scale of that largest tensor instead.
ZERO_TO_ROUNDING = 1e-12
LOW_PRECISION_FLOOR = {torch.float32: 5e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
LOW_PRECISION_CEILING = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def random_kata_state(N: int, H: int, fmap, V: int, *, seed: int, device):
    """A seeded `KataState` for tests (float64) that a prefix could have left: `S [N, H, P, V]` of either sign
    (0.5 · normal) and `z [N, H, P]` the normaliser of eight unit-normal keys, `Σ_j ψ(k_j)` of the feature map
    `fmap`, so that every read of it, `ψ(q)ᵀ z`, is nonnegative as in a real state (a normaliser off the cone
    reads negative or near-zero denominators, whose gradients no precision computes to a relative bound)."""
    from polyattn.ops.kata import KataState

    gen = torch.Generator().manual_seed(seed)
    S = 0.5 * torch.randn(N, H, fmap.dim(), V, generator=gen, dtype=torch.float64)
    keys = torch.randn(N, H, 8, fmap.K, generator=gen, dtype=torch.float64)  # [N, H, 8, K]
    z = fmap.write(keys, torch.ones(N, H, 8, 1, dtype=torch.float64))[..., 0]  # [N, H, P, 1] -> [N, H, P]
    return KataState(S.to(device), z.to(device))


def kata_gpu_cases(t_grid, variants) -> list:
    """The KATA kernels' GPU test grid of cases `(T, dtype, groups, combine, decay, normalize, with_state)`:
    KATA-M1 over `t_grid`, fp32 and bf16 and every flag, then each of the other `(groups, combine)`
    `variants` at T = 65 and 1000 in both dtypes with two opposite sets of flags."""
    dtypes = (torch.float32, torch.bfloat16)
    cases = [(T, dt, 1, "concat", d, n, s) for T in t_grid for dt in dtypes for d in (False, True) for n in (False, True)
             for s in (False, True)]
    return cases + [(T, dt, G, c, d, d, d) for T in (65, 1000) for dt in dtypes for G, c in variants if G > 1 for d in (False, True)]


def kata_case_id(case) -> str:
    """A parametrize id of a KATA test case, e.g. `T65-bf16-concat-G2-g-norm-h0`."""
    T, dtype, groups, combine, decay, normalize, with_state = case
    flags = f"{'g' if decay else 'nog'}-{'norm' if normalize else 'unnorm'}-{'h0' if with_state else 'noh0'}"
    return f"T{T}-{dtype_id(dtype)}-{combine}-G{groups}-{flags}"


def loglinear_prefix_state(make_inputs, positions: list[int], L: int, shape: tuple, *, device, seed: int = 1):
    """A `LogLinearState` reached by the naive log-linear form after a random prefix, per sequence at its
    own position: `make_inputs(P, seed, L)` gives a prefix's inputs (a dict of `loglinear_attn`'s
    arguments, beta among them for the Gated DeltaNet base); `shape = (H, K, V)`; position 0 is empty."""
    from polyattn.ops.loglinear import LogLinearState, loglinear_attn_naive

    H, K, V = shape
    levels = []
    for i, P in enumerate(positions):
        if P == 0:
            levels.append(torch.zeros(1, H, L, K, V, dtype=torch.float64, device=device))
            continue
        _, s = loglinear_attn_naive(**make_inputs(P, seed + i, L), scale=K**-0.5, output_final_state=True)
        levels.append(s.levels)
    return LogLinearState(torch.cat(levels), torch.tensor(positions, device=device))


def loglinear_occupied_only(form):
    """A log-linear `form` that reads only the levels an initial state can occupy at its position (as
    the Triton form does), the others zeroed."""
    from polyattn.ops.loglinear import LogLinearState
    from polyattn.ops.loglinear.state import occupied_levels

    def run(*tensors, initial_state=None, **kwargs):
        if initial_state is not None:
            occupied = occupied_levels(initial_state.position, initial_state.levels.shape[2])[:, None, :, None, None]
            initial_state = LogLinearState(torch.where(occupied, initial_state.levels, 0.0), initial_state.position)
        return form(*tensors, initial_state=initial_state, **kwargs)

    return run


def dtype_id(dtype: torch.dtype) -> str:
    """A short parametrize id for a dtype."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}[dtype]


def _named_fields(name: str, state) -> dict:
    """A state's floating tensors by name: ``{name: state}`` for a tensor, ``{name.S: .., name.z: ..}``
    for a NamedTuple (integer fields, e.g. log-linear positions, are not differentiated)."""
    if state is None:
        return {}
    if isinstance(state, torch.Tensor):
        return {name: state}
    return {f"{name}.{field}": x for field, x in zip(state._fields, state) if x.is_floating_point()}


def _state_like(state, fields):
    """``state`` with its floating tensors replaced, in order, by ``fields`` (integer fields kept)."""
    if isinstance(state, torch.Tensor):
        return fields[0]
    it = iter(fields)
    return type(state)(*(next(it) if x.is_floating_point() else x for x in state))


def forward_backward(
    form, inputs: dict, h0, cotangents, *, scale: float, cu_seqlens=None, backward: bool = True, final_state: bool = True,
) -> dict:
    """Forward + backward of one form of an op `form(*inputs.values(), scale=, initial_state=, ...)`
    (`backward=False`: the forward alone, without gradients, for a form that has none; `final_state=False`:
    called without `output_final_state`, as in training, dht unused).

    `inputs` is ordered as the op's positional tensors (None entries passed as None and not
    differentiated); `h0` a tensor, a NamedTuple state (e.g. `KataState`; integer fields passed as they are) or None; gradients
    flow through `o` and the final state with the cotangents `(do, dht)`, dht shaped like the
    final state. Returns `{"o", "final_state"..., "d<name>"..., "dh0"...}` (a NamedTuple state
    field by field, as `final_state.S`).
    """
    kwargs = dict(scale=scale, output_final_state=final_state)
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = cu_seqlens
    if not backward:
        with torch.no_grad():
            o, ht = form(*inputs.values(), initial_state=h0, **kwargs)
        return {"o": o, **_named_fields("final_state", ht)}
    leaves = {n: None if x is None else x.detach().clone().requires_grad_() for n, x in inputs.items()}
    h0_leaves = [x.detach().clone().requires_grad_() for x in _named_fields("h0", h0).values()]
    o, ht = form(*leaves.values(), initial_state=None if h0 is None else _state_like(h0, h0_leaves), **kwargs)
    do, dht = cotangents
    finals = _named_fields("final_state", ht) if final_state else {}
    loss = (o.double() * do).sum() + sum((x.double() * d).sum() for x, d in zip(finals.values(), _named_fields("", dht).values()))
    wrt = {n: x for n, x in leaves.items() if x is not None}
    grads = torch.autograd.grad(loss, [*wrt.values(), *h0_leaves], allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr for x, gr in zip([*wrt.values(), *h0_leaves], grads)]  # unused: zero
    out = {"o": o, **finals}
    out.update({f"d{n}": gr for n, gr in zip([*wrt, *_named_fields("h0", h0)], grads)})
    return out


def per_sequence(form, lengths: list[int]):
    """A form over packed sequences run one sequence at a time (the reference for `cu_seqlens`)."""
    from polyattn.ops.common import state_cat, state_index

    def run(*tensors, scale, initial_state, output_final_state):
        outs, states, bos = [], [], 0
        for i, n in enumerate(lengths):
            piece = [None if x is None else x[:, bos:bos + n] for x in tensors]
            o, s = form(*piece, scale=scale, initial_state=state_index(initial_state, i), output_final_state=output_final_state)
            outs.append(o)
            states.append(s)
            bos += n
        return torch.cat(outs, 1), state_cat(states) if output_final_state else None  # N x [1, T_i, H, V] -> [1, T, H, V]
    return run


def low_precision_errors(
    naive, chunk, fast, inputs: dict, h0, dtype, *, lengths=None, seed: int = 1, backward: bool = True, final_state: bool = True,
) -> dict:
    """`{tensor name: (rel_err(fast), bound)}` for `fast` (in `dtype`) against `naive` in float64
    on the same rounded inputs; the bound is the one stated above, set by `chunk` (the PyTorch chunk
    form, in `dtype`). With `lengths`, the inputs (B = 1) are packed sequences: `fast` gets
    `cu_seqlens`, the others run per sequence. `h0`: the initial state (a tensor, a NamedTuple of
    tensors, or None); the final-state cotangent is shaped like the final state. `backward=False`
    compares o and the final state of forwards without gradients; `final_state=False` calls the forms
    without `output_final_state` (as training does) and compares o and the gradients through o alone.
    Also checks dtypes and finiteness."""
    gen = torch.Generator().manual_seed(seed)
    q, v = inputs["q"], inputs["v"]
    Bx, T, Hx, Kx = q.shape
    low = {n: None if x is None else x.to(dtype) for n, x in inputs.items()}
    exact = {n: None if x is None else x.double() for n, x in low.items()}  # the same rounded inputs
    h0_exact = None if h0 is None else _state_like(h0, [x.double() for x in _named_fields("h0", h0).values()])
    cu = None
    if lengths is not None:
        naive, chunk = per_sequence(naive, lengths), per_sequence(chunk, lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=q.device)
    scale = Kx**-0.5
    with torch.no_grad():
        _, ht = naive(*exact.values(), scale=scale, initial_state=h0_exact, output_final_state=True)
    do = torch.randn(Bx, T, Hx, v.shape[-1], generator=gen, dtype=torch.float64).to(q.device)
    dht = _state_like(ht, [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(q.device) for x in _named_fields("", ht).values()])
    runs = dict(scale=scale, backward=backward, final_state=final_state)
    ref = forward_backward(naive, exact, h0_exact, (do, dht), **runs)
    base = forward_backward(chunk, low, h0, (do, dht), **runs)
    got = forward_backward(fast, low, h0, (do, dht), cu_seqlens=cu, **runs)
    errors = {}
    call_scale = max((x.abs().max().item() for x in ref.values() if x.numel()), default=0.0)
    for name, expected in ref.items():
        assert got[name].dtype == base[name].dtype, f"{name}: dtype {got[name].dtype} != {base[name].dtype}"
        assert bool(torch.isfinite(got[name]).all()), f"{name}: non-finite values"
        if expected.numel() and 0.0 < call_scale and expected.abs().max().item() <= ZERO_TO_ROUNDING * call_scale:
            err, err_chunk = ((x.detach().double() - expected.double()).abs().max().item() / call_scale for x in (got[name], base[name]))
        else:
            err, err_chunk = rel_err(got[name], expected), rel_err(base[name], expected)
        errors[name] = (err, min(max(2 * err_chunk, LOW_PRECISION_FLOOR[dtype]), LOW_PRECISION_CEILING[dtype]))
    return errors


def assert_low_precision_matches(
    naive, chunk, fast, inputs: dict, h0, dtype, *, lengths=None, seed: int = 1, backward: bool = True, final_state: bool = True,
) -> None:
    """Every tensor of `low_precision_errors` within its bound."""
    errors = low_precision_errors(
        naive, chunk, fast, inputs, h0, dtype, lengths=lengths, seed=seed, backward=backward, final_state=final_state,
    )
    for name, (err, bound) in errors.items():
        assert err <= bound, f"{name}: rel err {err:.2e} > {bound:.2e}"


def assert_one_token_step(fast, tensors: list, h0: torch.Tensor, *, scale: float = 0.3, rtol: float = 1e-5) -> None:
    """A one-token call of a Triton form without gradients (decoding, served by the fused step)
    equals the same call with gradients (served by the chunk kernels) and leaves `h0` untouched."""
    kept = h0.clone()
    with torch.no_grad():
        o, ht = fast(*tensors, scale=scale, initial_state=h0, output_final_state=True)
    leaves = [None if t is None else t.clone().requires_grad_() for t in tensors]
    o_ref, ht_ref = fast(*leaves, scale=scale, initial_state=h0, output_final_state=True)
    assert torch.equal(h0, kept), "the one-token call modified the caller's state"
    assert rel_err(o, o_ref) <= rtol, f"o: {rel_err(o, o_ref):.2e}"
    assert rel_err(ht, ht_ref) <= rtol, f"final state: {rel_err(ht, ht_ref):.2e}"


def assert_fused_steps(fused_step, reference_step, steps: list, state: torch.Tensor, *, scale: float = 0.3, rtol: float = 1e-5) -> None:
    """A fused in-place decoding step (`fused_step(*tokens, state, scale=)`, fp32 state) against
    the PyTorch step that returns a new state, over the per-step token tensors `steps`."""
    fused = state.float().contiguous()
    reference = state.clone()
    for t, tokens in enumerate(steps):
        o, same = fused_step(*(None if x is None else x.float() for x in tokens), fused, scale=scale)
        o_ref, reference = reference_step(*tokens, reference, scale=scale)
        assert same is fused, "the fused step must update the state in place"
        assert rel_err(o, o_ref) <= rtol, f"step {t}: o rel err {rel_err(o, o_ref):.2e}"
        assert rel_err(fused, reference) <= rtol, f"step {t}: state rel err {rel_err(fused, reference):.2e}"


def run_ranks(fn, world_size: int, args: tuple = (), *, timeout: float, start_method: str = "spawn") -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` processes (``torch.multiprocessing``); an error in one is raised
    here, and past ``timeout`` seconds every process is stopped and ``TimeoutError`` raised."""
    import time

    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=world_size, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(min(deadline - time.monotonic(), 1.0), 0.05)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} processes did not finish in {timeout:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()


@contextmanager
def poisoned_empty():
    """Inside, `torch.empty`, `torch.empty_like` and `Tensor.new_empty` return floating tensors filled with NaN, so
    that a kernel or a launcher that reads an element before anything wrote it (a scratch row a mask should have
    skipped, a gradient buffer a program never covers) gives NaN instead of whatever memory held. The test suite
    runs this way with `POLYATTN_POISON_EMPTY=1` (tests/conftest.py); restored on exit."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x

    torch.empty = lambda *args, **kwargs: poison(empty(*args, **kwargs))
    torch.empty_like = lambda *args, **kwargs: poison(empty_like(*args, **kwargs))
    torch.Tensor.new_empty = lambda self, *args, **kwargs: poison(new_empty(self, *args, **kwargs))
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = empty, empty_like, new_empty
