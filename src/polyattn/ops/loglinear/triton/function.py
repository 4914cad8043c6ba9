"""Custom ops and form function of the Triton `loglinear_attn` (Mamba-2 base, `beta=None`; the Gated
DeltaNet base, gdn.py, whose chunk-level states leave like the level pass's and give the final state the
same way, with `gdn_last_chunk_levels` for the last chunk's keys; the one-token step of both).

The kernels (level_pass.py) run on per-chunk-level states `R [N, H, NLC, K, V]`, the level pass's
block-rule states; a `LogLinearState` holds Fenwick levels of the last query. `fenwick_to_blocks`
and `blocks_to_fenwick` translate between the two in PyTorch (a few [N, H, L, K, V] tensors, on the
device, differentiable: no host read of the positions), and `first_chunk_reads` / `last_chunk_levels`
add the O(C) tokens per sequence that sit next to an initial state's keys inside one chunk
(ops/loglinear/README.md, "Triton kernels"). Forward: one causal pass `(q, k, v)`. Backward, with
`do`, `dR` (the gradient of the leaving states) and `dF` (of the final state's in-chunk levels F):

    dq = causal     pass(a=do, b=v,  c=k;  entering R^T)      + dlam (its per-level row dots with q)
    dv = anticausal pass(a=k,  b=q,  c=do; entering dR / scale) -> dR0 = scale * leaving state
    dk = anticausal pass(a=v,  b=do, c=q;  entering dR^T / scale)   (one walk with dv: `anticausal_pair`)
    dg = reverse_cumsum_within_sequence(q . dq - k . dk) + <dR, R> + <dF, F> at the last token

(dq, dk, dv, dlam with the edge terms' gradients added.) One token without gradients runs the fused
decoding step (step.py) instead.

The dg line is linear attention's identity, unchanged by the level weights: `lam` does not depend on
g, every pair's weight is `lam[t, level] exp(G_t - G_s)`, so `dL/dG_t` is the sum of its pair terms
as a query (`q_t . dq_t`) minus those as a key (`k_t . dk_t`).
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from polyattn.ops.common import one_token_step, wants_grad
from polyattn.ops.loglinear.state import LogLinearState, check_lam_levels, fenwick_carry, occupied_levels
from polyattn.ops.triton.plan import device_lengths, get_config, no_output, reverse_cumsum, sequence_lengths
from polyattn.ops.triton.precision import check_kernel_inputs

from .gdn import ChunkLocals, gdn_forward, gdn_levels_backward, kernel_heads
from .gdn_grads import gdn_chunk_backward
from .level_pass import anticausal_pair, level_pass
from .step import loglinear_attn_step_inplace


def _flatten(tensors, B: int, T: int):
    """`[B, T, H, ...]` -> `[B*T, H, ...]` contiguous (None passes through)."""
    return tuple(None if x is None else x.reshape(B * T, *x.shape[2:]).contiguous() for x in tensors)


def _levels_dim(L: int, C: int) -> int:
    """NLC: the chunk-levels of the level pass's state for `L` levels and chunk size C."""
    return max(L - C.bit_length(), 1)


class _Layout(NamedTuple):
    """What every op of a call derives from the host lengths and the positions: the lengths and the
    edge-chunk rows."""

    lengths: torch.Tensor  # [N]
    first: tuple  # (rows [N, C], real [N, C]) of first_chunk_rows
    last: tuple  # (rows [N, C], real [N, C]) of last_chunk_rows


def _layout(position, seq_lens, C, device) -> _Layout:
    lengths = device_lengths(seq_lens, device)  # [N]
    starts = lengths.cumsum(0) - lengths  # [N]
    return _Layout(lengths, first_chunk_rows(position, starts, lengths, C), last_chunk_rows(position, starts, lengths, C))


def _rows(x, rows):
    """`x: [N_tok, H, ...]` gathered at `rows [N, C]` in fp32 (None passes through)."""
    return None if x is None else x[rows].float()  # [N, C, H, ...]


@torch.library.custom_op("polyattn::loglinear_attn_forward", mutates_args=())
def loglinear_attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, g: torch.Tensor | None,
    r0: torch.Tensor | None, low: torch.Tensor | None, position: torch.Tensor, scale: float, seq_lens: list[int],
    chunk_size: int, store_final: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward as a custom op: `(o [B, T, H, V], R [N, H, NLC, K, V] fp32 (the states leaving the
    level pass), F [N, H, c + 1, K, V] fp32 (the final state's in-chunk levels; empty [0] without
    store_final))`. With an initial state (`r0` its per-chunk-level states, `low` its in-chunk groups)
    the reads of `low` are added to o in fp32 before the one rounding."""
    B, T, H, K = q.shape
    C = chunk_size
    qf, kf, vf, lamf, gf = _flatten((q, k, v, lam, g), B, T)
    layout = _layout(position, seq_lens, C, q.device)
    o, R, _, _ = level_pass(
        qf, kf, vf, gf, lamf, position, tuple(seq_lens), scale=scale, initial_state=r0,
        out_dtype=torch.float32 if low is not None else None, chunk_size=C, guard=True, rounded=not store_final,
    )
    if low is not None:
        rows, real = layout.first
        reads = first_chunk_reads(_rows(qf, rows), _rows(gf, rows), _rows(lamf, rows), low, position, real, scale=scale, C=C)
        o = o.index_add(0, rows[real], reads[real]).to(q.dtype)  # [B*T, H, V]
    F_low = no_output(q)
    if store_final:
        rows, real = layout.last
        F_low = last_chunk_levels(_rows(kf, rows), _rows(vf, rows), _rows(gf, rows), low, position, layout.lengths, real, C)
    return o.view(B, T, H, v.shape[-1]), R, F_low  # [B*T, H, V] -> [B, T, H, V]


@loglinear_attn_forward.register_fake
def _(q, k, v, lam, g, r0, low, position, scale, seq_lens, chunk_size, store_final):
    B, T, H, K = q.shape
    C = chunk_size
    NLC = _levels_dim(lam.shape[-1], C)
    N, V = len(seq_lens), v.shape[-1]
    F_low = q.new_empty(N, H, C.bit_length(), K, V, dtype=torch.float32) if store_final else no_output(q)
    return v.new_empty(B, T, H, V), q.new_empty(N, H, NLC, K, V, dtype=torch.float32), F_low


def _edge_grads(qf, kf, vf, lamf, gf, low, position, layout, do, dF, *, scale, C):
    """Gradients of the edge-chunk terms (`first_chunk_reads` with cotangent `do`, `last_chunk_levels`
    with `dF`): `{name: gradient}` for the q, lam rows of `layout.first`, the k, v rows of
    `layout.last` (`[N, C, H, *]` fp32) and low. Written out: the ops run below autograd."""
    grads = {}
    if low is not None:
        rows, real = layout.first
        w, qt, group, decay = first_chunk_weights(_rows(qf, rows), _rows(gf, rows), _rows(lamf, rows), position, real, scale=scale, C=C)
        D = torch.where(real[..., None, None], _rows(do, rows), 0.0)  # [N, C, H, V]
        Y = torch.einsum("njhv,nhlkv->njhlk", D, low)  # [N, C, H, c + 1, K]
        grads["q"] = torch.einsum("njhl,njhlk->njhk", w, Y) * decay[..., None]  # [N, C, H, K]
        dw = torch.einsum("njhk,njhlk->njhl", qt, Y)  # [N, C, H, c + 1]
        grads["lam"] = torch.zeros_like(lamf[rows], dtype=torch.float32).scatter_add(-1, group, dw)  # [N, C, H, L]
        grads["low"] = torch.einsum("njhl,njhk,njhv->nhlkv", w, qt, D)
    if dF is not None:
        rows, real = layout.last
        onehot, decay, move, total = last_chunk_weights(_rows(gf, rows), position, layout.lengths, real, C)
        k_r, v_r = _rows(kf, rows), _rows(vf, rows)  # [N, C, H, K], [N, C, H, V]
        grads["k"] = torch.einsum("njl,njhlk->njhk", onehot, torch.einsum("nhlkv,njhv->njhlk", dF, v_r)) * decay[..., None]
        grads["v"] = torch.einsum("njl,njhlv->njhv", onehot, torch.einsum("nhlkv,njhk->njhlv", dF, k_r)) * decay[..., None]
        if low is not None:
            grads["low"] = grads["low"] + torch.einsum("nlm,nh,nhmkv->nhlkv", move, total, dF)
    return grads


@torch.library.custom_op("polyattn::loglinear_attn_backward", mutates_args=())
def loglinear_attn_backward(
    do: torch.Tensor, dR: torch.Tensor | None, dF: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, lam: torch.Tensor, g: torch.Tensor | None, r0: torch.Tensor | None, low: torch.Tensor | None,
    position: torch.Tensor, R: torch.Tensor | None, F_low: torch.Tensor, scale: float, seq_lens: list[int], chunk_size: int,
    want_dg: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three backward passes, the edge-chunk terms and dg as a custom op: `(dq, dk, dv, dlam, dg,
    dR0, dlow)`; dg without want_dg, dR0 without r0 and dlow without low are empty [0] tensors. Every
    gradient that gets edge terms is summed in fp32 and rounded once."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    seq_lens = tuple(seq_lens)
    qf, kf, vf, lamf, gf, dof = _flatten((q, k, v, lam, g, do), B, T)
    layout = _layout(position, seq_lens, C, q.device)
    f32 = torch.float32
    dRs = dR / scale if dR is not None else None  # the reverse states' units
    dq, _, q_dq, dlam = level_pass(
        dof, vf, kf, gf, lamf, position, seq_lens, scale=scale,
        initial_state=r0.transpose(-1, -2) if r0 is not None else None, dot_x=qf, want_dlam=True,
        out_dtype=f32 if low is not None else None, chunk_size=C,
    )
    dv, dk, dR0, k_dk = anticausal_pair(
        kf, qf, dof, vf, gf, lamf, position, seq_lens, scale=scale, initial_state=dRs, dot_x=kf if want_dg else None,
        out_dtype=f32 if dF is not None else None, chunk_size=C,
    )
    edge = _edge_grads(qf, kf, vf, lamf, gf, low, position, layout, dof, dF, scale=scale, C=C)
    if "q" in edge:
        rows, real = layout.first
        dq = dq.index_add(0, rows[real], edge["q"][real])  # [B*T, H, K] fp32
        dlam = dlam.index_add(0, rows[real], edge["lam"][real])
        if want_dg:
            q_dq = q_dq.index_add(0, rows[real], (qf[rows].float() * edge["q"]).sum(-1)[real])
    if "k" in edge:
        rows, real = layout.last
        dk = dk.index_add(0, rows[real], edge["k"][real])
        dv = dv.index_add(0, rows[real], edge["v"][real])
        if want_dg:
            k_dk = k_dk.index_add(0, rows[real], (kf[rows].float() * edge["k"]).sum(-1)[real])
    dg = no_output(q)
    if want_dg:
        db = q_dq - k_dk  # [B*T, H]
        ends = layout.lengths.cumsum(0) - 1  # [N]
        if dR is not None:
            db = db.index_add(0, ends, (dR * R).sum((-1, -2, -3)))  # [N, H, NLC, K, V] -> [N, H]
        if dF is not None:
            db = db.index_add(0, ends, (dF * F_low).sum((-1, -2, -3)))  # [N, H, c + 1, K, V] -> [N, H]
        dg = reverse_cumsum(db, seq_lens).view(B, T, H).to(g.dtype)  # [B*T, H] -> [B, T, H]
    dR0 = dR0 * scale if r0 is not None else no_output(q)
    dlow = edge["low"] if low is not None else no_output(q)
    return (
        dq.to(q.dtype).view(B, T, H, K), dk.to(k.dtype).view(B, T, H, K), dv.to(v.dtype).view(B, T, H, V),
        dlam.to(lam.dtype).view(lam.shape), dg, dR0, dlow,
    )


@loglinear_attn_backward.register_fake
def _(do, dR, dF, q, k, v, lam, g, r0, low, position, R, F_low, scale, seq_lens, chunk_size, want_dg):
    dg = g.new_empty(g.shape) if want_dg else no_output(q)
    dR0 = r0.new_empty(r0.shape, dtype=torch.float32) if r0 is not None else no_output(q)
    dlow = low.new_empty(low.shape, dtype=torch.float32) if low is not None else no_output(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), lam.new_empty(lam.shape), dg, dR0, dlow


def _setup_context(ctx, inputs, output):
    q, k, v, lam, g, r0, low, position, scale, seq_lens, chunk_size, store_final = inputs
    R = output[1] if store_final else None  # without a final state nobody reads R: its gradient is zeros
    ctx.save_for_backward(q, k, v, lam, g, r0, low, position, R, output[2])
    ctx.scale, ctx.seq_lens, ctx.chunk_size = scale, seq_lens, chunk_size
    ctx.set_materialize_grads(False)  # no zeros filled for R's gradient when nobody read it (0.05 ms at 2K x 32 on an H100)


def _backward(ctx, do, dR, dF):
    q, k, v, lam, g, r0, low, position, R, F_low = ctx.saved_tensors
    want_dg = g is not None and ctx.needs_input_grad[4]
    do = torch.zeros_like(v) if do is None else do  # o unused: only the final state carries a gradient
    dR = dR if R is not None else None  # R's gradient where nobody read it (None, or zeros): no entering states, no dg term
    dF = dF if dF is not None and dF.numel() else None
    dq, dk, dv, dlam, dg, dR0, dlow = loglinear_attn_backward(
        do.contiguous(), dR, dF, q, k, v, lam, g, r0, low, position, R, F_low, ctx.scale, ctx.seq_lens, ctx.chunk_size, want_dg,
    )
    return (
        dq, dk, dv, dlam, dg if want_dg else None, dR0 if r0 is not None else None,
        dlow if low is not None else None, None, None, None, None, None,
    )


loglinear_attn_forward.register_autograd(_backward, setup_context=_setup_context)


def bit_length(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Elementwise `bit_length` of a non-negative int64 tensor below `2**bits`."""
    n = torch.zeros_like(x)
    for b in range(bits):
        n += (x >> b > 0).long()
    return n


def fenwick_to_blocks(levels: torch.Tensor, position: torch.Tensor, C: int, NLC: int):
    """An initial state's Fenwick levels `[N, H, L, K, V]` (fp32, only its occupied levels) as the level
    pass's entering states `R [N, H, NLC, K, V]`, and its in-chunk groups `low [N, H, c + 1, K, V]`.

    At a position on the chunk grid the state is first carried to the view of the next query (its
    groups then all sit in chunk-levels); else its levels `0..c` are keys of the first chunk (`low`).
    Chunk-level `ell` of the first chunk `n0` is Fenwick level `c + 1 + ell`; the level pass wants
    that where bit `ell` of `n0` is set (a read), and elsewhere everything before `n0` inside the
    same `2^ell`-block, i.e. the lower chunk-levels and the in-chunk groups (they join `n0`'s adds).
    """
    c = C.bit_length() - 1
    width = c + 1 + NLC
    if levels.shape[2] < width:
        levels = F.pad(levels, [0, 0, 0, 0, 0, width - levels.shape[2]])  # [N, H, L, K, V] -> [N, H, width, K, V]
    on_grid = (position % C == 0)[:, None, None, None, None]
    levels = torch.where(on_grid, fenwick_carry(levels, position), levels)
    low, high = levels[:, :, : c + 1], levels[:, :, c + 1 : width]  # [N, H, c + 1, K, V], [N, H, NLC, K, V]
    bits = ((position // C)[:, None] >> torch.arange(NLC, device=position.device)) & 1  # [N, NLC]
    below = torch.cumsum(high, dim=2) - high + low.sum(2, keepdim=True)  # [N, H, NLC, K, V]
    return torch.where(bits[:, None, :, None, None] == 1, high, below), low


def first_chunk_rows(position, starts, lengths, C: int):
    """`(rows [N, C] token indices, real [N, C])`: the tokens that share the chunk of an initial
    state's last key (`P + j` in the chunk of `P`, only when `P mod C > 0`)."""
    j = torch.arange(C, device=position.device)
    r0 = position % C  # [N]
    real = (j[None] < C - r0[:, None]) & (j[None] < lengths[:, None]) & (r0[:, None] > 0)  # [N, C]
    return torch.where(real, starts[:, None] + j, 0), real


def first_chunk_weights(q, g, lam, position, real, *, scale, C):
    """The pieces of `first_chunk_reads` for the rows of `first_chunk_rows` (q, lam: [N, C, H, *]
    fp32, g: [N, C, H] or None): `(w [N, C, H, c + 1] = lam[j, max(l, level(P + j, P - 1))],
    q̃ = exp(G) scale q [N, C, H, K], the level indices [N, C, H, c + 1], exp(G) scale [N, C, H])`."""
    c = C.bit_length() - 1
    L = lam.shape[-1]
    j = torch.arange(C, device=q.device)
    q = torch.where(real[..., None, None], q, 0.0)  # [N, C, H, K]
    G = torch.zeros(q.shape[:3], device=q.device) if g is None else torch.cumsum(torch.where(real[..., None], g, 0.0), 1)  # [N, C, H]
    m = bit_length((position[:, None] + j) ^ (position[:, None] - 1).clamp(min=0), c + 1)  # [N, C]: level(P + j, P - 1)
    group = torch.maximum(torch.arange(c + 1, device=q.device)[None, None], m[..., None]).clamp(max=L - 1)  # [N, C, c + 1]
    group = group[:, :, None].expand(-1, -1, q.shape[2], -1)  # [N, C, H, c + 1]
    decay = torch.exp(G) * scale  # [N, C, H]
    return torch.gather(lam, -1, group), q * decay[..., None], group, decay


def first_chunk_reads(q, g, lam, low, position, real, *, scale, C):
    """The reads of an initial state's in-chunk groups `low [N, H, c + 1, K, V]` by the rest of their
    chunk, rows `j` of `first_chunk_rows`: group `l` at level `max(l, level(P + j, P - 1))` (the
    groups are nested), through `q̃ = exp(G) scale q`. Returns `[N, C, H, V]` fp32."""
    w, qt, _, _ = first_chunk_weights(q, g, lam, position, real, scale=scale, C=C)
    return torch.einsum("njhl,njhk,nhlkv->njhv", w, qt, low)  # [N, C, H, V]


def last_chunk_rows(position, starts, lengths, C: int):
    """`(rows [N, C] token indices, real [N, C])`: the tokens of the chunk of each sequence's last query."""
    E = position + lengths  # [N]
    apos = torch.div(E - 1, C, rounding_mode="floor")[:, None] * C + torch.arange(C, device=position.device)  # [N, C]
    real = (apos >= position[:, None]) & (apos < E[:, None])  # [N, C]
    return torch.where(real, starts[:, None] + apos - position[:, None], 0), real


def last_chunk_weights(g, position, lengths, real, C: int):
    """The pieces of `last_chunk_levels` for the rows of `last_chunk_rows` (g: [N, C, H] or None):
    `(onehot [N, C, c + 1] of level(E - 1, s), exp(g_{s+1} + ... + g_{E-1}) [N, C, H], move
    [N, c + 1, c + 1] (initial group l -> final level, zero unless the sequence stayed in its first
    chunk), the whole decay [N, H])`."""
    c = C.bit_length() - 1
    E = position + lengths  # [N]
    n1 = torch.div(E - 1, C, rounding_mode="floor")  # [N]
    apos = n1[:, None] * C + torch.arange(C, device=position.device)  # [N, C]
    gj = torch.zeros(*real.shape, 1, device=position.device) if g is None else torch.where(real[..., None], g, 0.0)  # [N, C, H]
    to_end = torch.flip(torch.cumsum(torch.flip(gj, [1]), 1), [1]) - gj  # [N, C, H]: g_{s+1} + ... (padding rows are 0)
    lev = bit_length((E[:, None] - 1).clamp(min=0) ^ apos.clamp(min=0), c + 1)  # [N, C]
    levels = torch.arange(c + 1, device=position.device)
    onehot = (lev[..., None] == levels).float() * real[..., None]  # [N, C, c + 1]
    same = ((position // C == n1) & (position % C > 0)).float()  # [N]: the sequence stayed in its first chunk
    m_end = bit_length((E - 1).clamp(min=0) ^ (position - 1).clamp(min=0), c + 1)  # [N]
    to = torch.maximum(levels[None], m_end[:, None])  # [N, c + 1]
    move = (to[..., None] == levels).float() * same[:, None, None]  # [N, c + 1 (from), c + 1 (to)]
    return onehot, torch.exp(to_end), move, torch.exp(gj.sum(1))


def last_chunk_levels(k, v, g, low, position, lengths, real, C: int):
    """Fenwick levels `0..c` of the final state `[N, H, c + 1, K, V]` from the rows of
    `last_chunk_rows` (k, v: [N, C, H, *] fp32): the keys of the last query's chunk at
    `level(E - 1, s)`, carried to `E - 1`, plus the initial in-chunk groups `low` when the sequence
    never left their chunk (at `max(l, level(E - 1, P - 1))`)."""
    onehot, decay, move, total = last_chunk_weights(g, position, lengths, real, C)
    levels = torch.einsum("njl,njh,njhk,njhv->nhlkv", onehot, decay, k, v)  # [N, H, c + 1, K, V]
    if low is None:
        return levels
    return levels + torch.einsum("nlm,nh,nhlkv->nhmkv", move, total, low)


def gdn_last_chunk_levels(k, v, g, beta, t_inv, w, low, position, lengths, real, C: int):
    """Fenwick levels `0..c` of the final state `[N, H, c + 1, K, V]` from the rows of `last_chunk_rows`
    (k, v, w: [N, C, H, *] with w the WY factor W; g, beta: [N, C, H]; t_inv: [N, C, H, C] fp32, the
    rows of the inverse, whose columns start at the chunk's first token): the keys of the last query's
    chunk at `level(E - 1, s)`, each carried to `E - 1` through the delta rule of the rows after it,
    `diag(β) Tinv^T K̃` with `K̃_s = exp(g_{s+1} + ... + g_{E-1}) k_s`; plus, when the sequence never
    left an initial state's chunk, its groups `low` carried through the sequence (`exp(G) low - K̃^T W
    low`) at `max(l, level(E - 1, P - 1))`."""
    onehot, decay, move, total = last_chunk_weights(g, position, lengths, real, C)
    n1 = torch.div(position + lengths - 1, C, rounding_mode="floor")  # [N]
    off = torch.where(n1 == position // C, position % C, 0)  # [N]: the chunk's first token on the grid
    j = torch.arange(C, device=position.device)
    cols = (j[None] - off[:, None]).clamp(min=0)  # [N, C]: row j's column in t_inv
    t_inv = torch.gather(t_inv, -1, cols[:, None, None, :].expand_as(t_inv)) * (j[None] >= off[:, None])[:, None, None, :]
    kd = torch.where(real[..., None, None], k * decay[..., None], 0.0)  # [N, C, H, K]: K̃ (padding rows 0)
    carried = torch.einsum("nihj,nihk->njhk", t_inv, kd) * beta[..., None]  # [N, C, H, K]
    levels = torch.einsum("njl,njhk,njhv->nhlkv", onehot, carried, v)  # [N, H, c + 1, K, V]
    if low is None:
        return levels
    w = torch.where(real[..., None, None], w, 0.0)
    through = total[:, :, None, None, None] * low - torch.einsum("njhk,njhlv->nhlkv", kd, torch.einsum("njhk,nhlkv->njhlv", w, low))
    return levels + torch.einsum("nlm,nhlkv->nhmkv", move, through)


def blocks_to_fenwick(R: torch.Tensor, low_levels: torch.Tensor, position: torch.Tensor, lengths: torch.Tensor, C: int, L: int):
    """The final `LogLinearState` levels `[N, H, L, K, V]`: levels `0..c` from `last_chunk_levels`,
    level `c + 1 + ell` the leaving state `R[ell]` where bit `ell` of the last chunk index is set
    (the first half of that block: chunk-level `ell` of the last query), empty elsewhere."""
    NLC = R.shape[2]
    n1 = torch.div(position + lengths - 1, C, rounding_mode="floor")  # [N]
    bits = (n1[:, None] >> torch.arange(NLC, device=R.device)) & 1  # [N, NLC]
    high = torch.where(bits[:, None, :, None, None] == 1, R, 0.0)  # [N, H, NLC, K, V]
    return torch.cat([low_levels, high], dim=2)[:, :, :L]  # [N, H, c + 1 + NLC, K, V] -> [N, H, L, K, V]


def loglinear_attn_fused(q, k, v, lam, g=None, *, beta=None, scale, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Triton form of `loglinear_attn` (inputs already validated, scale resolved): the Mamba-2 base, and
    with `beta` the Gated DeltaNet base (gdn.py), both with gradients, and the one-token step.

    q, k: [B, T, H, K]; v: [B, T, H, V]; lam: [B, T, H, L]; g: [B, T, H] or None; initial_state:
    `LogLinearState` with levels [N, H, L, K, V] (only the levels a state can occupy at its position
    are read, `occupied_levels`); cu_seqlens: int [N + 1] with B == 1, handled natively (one host
    read of the offsets, none of the positions). One token per sequence without gradients
    (decoding) runs the fused step (step.py) on a copy of the levels. Returns `(o [B, T, H, V] in
    q's dtype, LogLinearState or None)`.
    """
    check_kernel_inputs(q)
    B, T, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    C = get_config().chunk_size
    seq_lens = sequence_lengths(cu_seqlens, B, T)
    N = len(seq_lens)
    lengths = device_lengths(seq_lens, q.device)  # [N]
    check_lam_levels(L, initial_state, T if cu_seqlens is None else lengths)
    if initial_state is not None:
        position = initial_state.position
        occupied = occupied_levels(position, L)[:, None, :, None, None]  # [N, 1, L, 1, 1]
        levels = torch.where(occupied, initial_state.levels.float(), 0.0)  # levels that hold no keys at the position are not read
    else:
        position = torch.zeros(N, dtype=torch.int64, device=q.device)
    if q.numel() != 0 and one_token_step(q, cu_seqlens, (q, k, v, lam, g, beta, initial_state)):
        state = initial_state.levels.to(torch.float32, copy=True).contiguous() if initial_state is not None else q.new_zeros(B, H, L, K, V, dtype=torch.float32)
        o, state = loglinear_attn_step_inplace(
            q[:, 0], k[:, 0], v[:, 0], lam[:, 0], None if g is None else g[:, 0], state, position, scale=scale,
            beta=None if beta is None else beta[:, 0],
        )
        return o[:, None], (LogLinearState(state, position + 1) if output_final_state else None)  # [B, H, V] -> [B, 1, H, V]
    if q.numel() == 0:
        o = v.new_zeros(B, T, H, V, dtype=q.dtype)
        if not output_final_state:
            return o, None
        final = levels if initial_state is not None else q.new_zeros(N, H, L, K, V, dtype=torch.float32)
        return o, LogLinearState(final, position + lengths)
    r0, low = (None, None) if initial_state is None else fenwick_to_blocks(levels, position, C, _levels_dim(L, C))
    if beta is not None:
        o, R, F_low = _gdn_padded(q, k, v, lam, g, beta, r0, low, position, scale, seq_lens, output_final_state)
    else:
        o, R, F_low = loglinear_attn_forward(q, k, v, lam, g, r0, low, position, scale, list(seq_lens), C, output_final_state)
    if not output_final_state:
        return o, None
    return o, LogLinearState(blocks_to_fenwick(R, F_low, position, lengths, C, L), position + lengths)


def _gdn_padded(q, k, v, lam, g, beta, r0, low, *rest):
    """`_gdn_with_edges` on heads zero-padded to the widths its kernels run at (`gdn.kernel_heads`; q, k in
    their last dim, v and the states' value columns in theirs), the padding cut from o, R and F_low."""
    K, V = q.shape[-1], v.shape[-1]
    Kp, Vp = kernel_heads(K, V)
    if (Kp, Vp) == (K, V):
        return _gdn_with_edges(q, k, v, lam, g, beta, r0, low, *rest)
    keys, states = (0, Kp - K), (0, Vp - V, 0, Kp - K)
    r0, low = (None if x is None else F.pad(x, states) for x in (r0, low))  # [..., K, V] -> [..., Kp, Vp]
    o, R, F_low = _gdn_with_edges(F.pad(q, keys), F.pad(k, keys), F.pad(v, (0, Vp - V)), lam, g, beta, r0, low, *rest)
    return o[..., :V].contiguous(), R[..., :K, :V], None if F_low is None else F_low[..., :K, :V]


def _gdn_with_edges(q, k, v, lam, g, beta, r0, low, position, scale, seq_lens, store_final):
    """The Gated DeltaNet base: the kernels' custom op, then in PyTorch (differentiable) the reads of an
    initial state's in-chunk groups `low` by the rest of their chunk, through q̃, and the final state's
    in-chunk levels (`gdn_last_chunk_levels`, from the last chunk's rows of Tinv and W). Returns `(o,
    R, F_low or None)`. Where both parts are differentiated in bf16/fp16, one fp32 copy of every input
    feeds both (the op casts it back for its kernels and returns fp32 gradients), so that each input's
    gradient is a sum in fp32, rounded once: the two parts' rounded gradients added in bf16 put dv at
    T = 1 and dbeta at T = 300 over twice the chunk form's error on the H200 (4.16e-3 against 4.04e-3,
    3.96e-3 against 3.91e-3)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = get_config().chunk_size
    dtype = q.dtype
    if (low is not None or store_final) and dtype != torch.float32 and wants_grad((q, k, v, lam, g, beta, r0)):
        q, k, v, lam, g, beta = (None if x is None else x.float() for x in (q, k, v, lam, g, beta))
    o, R, qt_first, t_inv_last, w_last = loglinear_gdn_forward(
        q, k, v, lam, g, beta, r0, position, scale, list(seq_lens), low is not None, store_final, dtype,
    )
    if low is None and not store_final:
        return o, R, None
    layout = _layout(position, seq_lens, C, q.device)
    qf, kf, vf, lamf, gf, bf = _flatten((q, k, v, lam, g, beta), B, T)
    if low is not None:
        rows, real = layout.first
        weights = first_chunk_weights(_rows(qf, rows), _rows(gf, rows), _rows(lamf, rows), position, real, scale=scale, C=C)[0]
        reads = torch.einsum("njhl,njhk,nhlkv->njhv", weights, qt_first, low)  # [N, C, H, V]
        o = o.view(B * T, H, V).index_add(0, rows[real], reads[real]).to(dtype).view(B, T, H, V)
    if not store_final:
        return o, R, None
    rows, real = layout.last
    F_low = gdn_last_chunk_levels(
        _rows(kf, rows), _rows(vf, rows), _rows(gf, rows), _rows(bf, rows), t_inv_last, w_last, low, position, layout.lengths, real, C,
    )
    return o, R, F_low


def _kernel_inputs(tensors, dtype: torch.dtype, B: int, T: int):
    """The inputs as the kernels take them: flattened, in `dtype` (fp32 copies of `dtype` values cast back
    exactly; g as it comes)."""
    *tensors, g = tensors
    return (*_flatten([None if x is None else x.to(dtype) for x in tensors], B, T), *_flatten((g,), B, T))


_INPUT_HEADS = {"q": 2, "k": 2, "v": 2, "lam": 2, "g": 2, "beta": 2, "r0": 1}  # the head dim of each op input


def _by_heads(body, heads: dict, out_heads: tuple, H: int, **args):
    """`body(**args)` over groups of `KernelConfig.gdn_heads` heads (None: all, one call): each tensor argument
    named in `heads` narrowed to the group along its head dim, the outputs (their head dims `out_heads`; empty
    [0] stand-ins pass through) written into tensors of all H heads. Each group's fp32 work tensors are freed
    before the next group's are made. ValueError for a group size below 1."""
    size = get_config().gdn_heads
    if size is not None and size < 1:
        raise ValueError(f"KernelConfig.gdn_heads: expected at least 1 or None, got {size}")
    if size is None or size >= H:
        return body(**args)
    outs = None
    for h0 in range(0, H, size):
        n = min(size, H - h0)
        group = {name: x.narrow(heads[name], h0, n) if name in heads and x is not None else x for name, x in args.items()}
        got = body(**group)
        if outs is None:
            outs = [x if x.shape == (0,) else x.new_empty(*x.shape[:d], H, *x.shape[d + 1:]) for x, d in zip(got, out_heads)]
        for out, x, d in zip(outs, got, out_heads):
            if x.shape != (0,):
                out.narrow(d, h0, n).copy_(x)
    return tuple(outs)


@torch.library.custom_op("polyattn::loglinear_gdn_forward", mutates_args=())
def loglinear_gdn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor,
    r0: torch.Tensor | None, position: torch.Tensor, scale: float, seq_lens: list[int], first_reads: bool, store_final: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gated DeltaNet base's kernels (gdn.py) as a custom op: `(o [B, T, H, V] (fp32 with first_reads,
    else dtype), R [N, H, NLC, K, V] fp32 (the chunk-level states leaving the walk), q̃ at the rows
    of `first_chunk_rows` [N, C, H, K] (with first_reads), Tinv [N, C, H, C] and W [N, C, H, K] at the
    rows of `last_chunk_rows` (with store_final))`, fp32, the rows' pieces empty [0] tensors otherwise.
    dtype: the kernels' input dtype (q, k, v, lam, beta may come as fp32 copies of such values). The heads run
    in groups of `KernelConfig.gdn_heads` (`_by_heads`)."""
    return _by_heads(
        _gdn_forward_heads, _INPUT_HEADS, (2, 1, 2, 2, 2), q.shape[2],
        q=q, k=k, v=v, lam=lam, g=g, beta=beta, r0=r0, position=position, scale=scale, seq_lens=seq_lens,
        first_reads=first_reads, store_final=store_final, dtype=dtype,
    )


def _gdn_forward_heads(q, k, v, lam, g, beta, r0, position, scale, seq_lens, first_reads, store_final, dtype):
    """`loglinear_gdn_forward` for one group of heads."""
    B, T, H, K = q.shape
    C = get_config().chunk_size
    qf, kf, vf, lamf, bf, gf = _kernel_inputs((q, k, v, lam, beta, g), dtype, B, T)
    fwd = gdn_forward(
        qf, kf, vf, gf, bf, lamf, tuple(seq_lens), position, scale=scale, r0=r0,
        out_dtype=torch.float32 if first_reads else None,
    )
    o, R, qt_first, t_inv_last, w_last = fwd.o, fwd.R, no_output(q), no_output(q), no_output(q)
    if first_reads or store_final:
        layout = _layout(position, seq_lens, C, q.device)
        if first_reads:
            qt_first = fwd.qt[layout.first[0]]
        if store_final:
            t_inv_last, w_last = fwd.t_inv[layout.last[0]], fwd.w[layout.last[0]]
    return o.view(B, T, H, v.shape[-1]), R, qt_first, t_inv_last, w_last  # [B*T, H, V] -> [B, T, H, V]


@loglinear_gdn_forward.register_fake
def _(q, k, v, lam, g, beta, r0, position, scale, seq_lens, first_reads, store_final, dtype):
    B, T, H, K = q.shape
    C = get_config().chunk_size
    N, V = len(seq_lens), v.shape[-1]
    R = q.new_empty(N, H, _levels_dim(lam.shape[-1], C), K, V, dtype=torch.float32)
    o = q.new_empty(B, T, H, V, dtype=torch.float32 if first_reads else dtype)
    qt_first = q.new_empty(N, C, H, K, dtype=torch.float32) if first_reads else no_output(q)
    last = (q.new_empty(N, C, H, C, dtype=torch.float32), q.new_empty(N, C, H, K, dtype=torch.float32)) if store_final else (no_output(q), no_output(q))
    return o, R, qt_first, *last


@torch.library.custom_op("polyattn::loglinear_gdn_backward", mutates_args=())
def loglinear_gdn_backward(
    do: torch.Tensor, dR: torch.Tensor | None, dqt_first: torch.Tensor | None, dt_inv_last: torch.Tensor | None,
    dw_last: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor,
    g: torch.Tensor | None, beta: torch.Tensor, r0: torch.Tensor | None, position: torch.Tensor, scale: float,
    seq_lens: list[int], dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gated DeltaNet base's backward as a custom op: `(dq, dk, dv, dlam, dg, dbeta, dr0)` in the dtypes
    of the inputs as given (fp32 copies get unrounded fp32 gradients; dg without g and dr0 without r0 are
    empty [0] tensors); the kernels run in `dtype`. The forward's levels rerun, storing the level states
    entering every S-th chunk (`gdn.checkpoint_plan`), `gdn.gdn_levels_backward` recomputes the states
    entering each block's chunks from them and walks the block in reverse (dq̃, dW, dŪ, dK̃, the
    chunk state factors' and the levels' lam gradients, dr0), and `gdn_grads.gdn_chunk_backward` takes
    those, with the gradients of the edge rows' q̃, Tinv and W, through the chunk-local stage. The heads run in
    groups of `KernelConfig.gdn_heads` (`_by_heads`)."""
    return _by_heads(
        _gdn_backward_heads, {"do": 2, "dR": 1, "dqt_first": 2, "dt_inv_last": 2, "dw_last": 2, **_INPUT_HEADS},
        (2, 2, 2, 2, 2, 2, 1), q.shape[2],
        do=do, dR=dR, dqt_first=dqt_first, dt_inv_last=dt_inv_last, dw_last=dw_last, q=q, k=k, v=v, lam=lam, g=g,
        beta=beta, r0=r0, position=position, scale=scale, seq_lens=seq_lens, dtype=dtype,
    )


def _gdn_backward_heads(do, dR, dqt_first, dt_inv_last, dw_last, q, k, v, lam, g, beta, r0, position, scale, seq_lens, dtype):
    """`loglinear_gdn_backward` for one group of heads."""
    B, T, H, K = q.shape
    C = get_config().chunk_size
    seq_lens = tuple(seq_lens)
    qf, kf, vf, lamf, bf, gf = _kernel_inputs((q, k, v, lam, beta, g), dtype, B, T)
    (dof,) = _flatten((do,), B, T)
    # the rerun's leaving states are read by nobody: freed before the level backward makes its round buffers
    fwd = gdn_forward(qf, kf, vf, gf, bf, lamf, seq_lens, position, scale=scale, r0=r0, store_ck=True)._replace(R=None)
    dqt, dw, dkt, du, dlast, dlam_levels, dr0 = gdn_levels_backward(kf, gf, lamf, fwd, dof, dR, seq_lens, position)
    dr0 = dr0 if r0 is not None else no_output(q)  # kept through the chunk-local backward only where it is returned
    t_inv, w, chunks = fwd.t_inv, fwd.w, fwd.chunks
    del fwd  # the checkpoints
    dt_inv = None
    layout = _layout(position, seq_lens, C, q.device) if dqt_first is not None or dt_inv_last is not None or dw_last is not None else None
    if dqt_first is not None:
        rows, real = layout.first
        dqt = dqt.index_add(0, rows[real], dqt_first[real])
    if dt_inv_last is not None or dw_last is not None:
        rows, real = layout.last
        if dt_inv_last is not None:
            dt_inv = torch.zeros(B * T, H, C, dtype=torch.float32, device=q.device).index_add(0, rows[real], dt_inv_last[real])
        if dw_last is not None:
            dw = dw.index_add(0, rows[real], dw_last[real])
    grads = ChunkLocals(dof, dqt, dw, du, dkt, dt_inv, dlast)
    dq, dk, dv, dg, dbeta, dlam = gdn_chunk_backward(qf, kf, vf, gf, bf, lamf, t_inv, w, grads, chunks, scale=scale, grad_dtype=q.dtype)
    dlam = dlam.add_(dlam_levels)
    return (
        dq.view(q.shape), dk.view(k.shape), dv.view(v.shape),
        dlam.to(lam.dtype).view(lam.shape), dg.to(g.dtype).view(g.shape) if g is not None else no_output(q),
        dbeta.to(beta.dtype).view(beta.shape), dr0,
    )


@loglinear_gdn_backward.register_fake
def _(do, dR, dqt_first, dt_inv_last, dw_last, q, k, v, lam, g, beta, r0, position, scale, seq_lens, dtype):
    dg = g.new_empty(g.shape) if g is not None else no_output(q)
    dr0 = r0.new_empty(r0.shape, dtype=torch.float32) if r0 is not None else no_output(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), lam.new_empty(lam.shape), dg, beta.new_empty(beta.shape), dr0


def _gdn_setup_context(ctx, inputs, output):
    q, k, v, lam, g, beta, r0, position, scale, seq_lens, first_reads, store_final, dtype = inputs
    ctx.save_for_backward(q, k, v, lam, g, beta, r0, position)
    ctx.scale, ctx.seq_lens, ctx.dtype, ctx.store_final = scale, seq_lens, dtype, store_final
    ctx.set_materialize_grads(False)  # no zeros filled for the gradients of outputs nobody read


def _gdn_backward(ctx, do, dR, dqt_first, dt_inv_last, dw_last):
    q, k, v, lam, g, beta, r0, position = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do  # o unused: only the final state carries a gradient
    dR = dR if ctx.store_final else None  # R's gradient where nobody read it (None, or zeros): no entering states
    present = lambda x: x if x is not None and x.numel() else None  # noqa: E731  (the rows' pieces may be empty)
    dq, dk, dv, dlam, dg, dbeta, dr0 = loglinear_gdn_backward(
        do.contiguous(), dR, present(dqt_first), present(dt_inv_last), present(dw_last), q, k, v, lam, g, beta, r0, position,
        ctx.scale, ctx.seq_lens, ctx.dtype,
    )
    return dq, dk, dv, dlam, dg if g is not None else None, dbeta, dr0 if r0 is not None else None, None, None, None, None, None, None


loglinear_gdn_forward.register_autograd(_gdn_backward, setup_context=_gdn_setup_context)
