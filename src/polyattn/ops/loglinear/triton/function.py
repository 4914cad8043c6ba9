"""Custom ops and form function of the Triton `loglinear_attn` (Mamba-2 base, `beta=None`).

The kernels (level_pass.py) run on per-chunk-level states `R [N, H, NLC, K, V]`, the level pass's
block-rule states; a `LogLinearState` holds Fenwick levels of the last query. `fenwick_to_blocks`
and `blocks_to_fenwick` translate between the two in PyTorch (a few [N, H, L, K, V] tensors, on the
device, differentiable: no host read of the positions), and `first_chunk_reads` / `last_chunk_levels`
add the O(C) tokens per sequence that sit next to an initial state's keys inside one chunk
(ops/loglinear/README.md, "Triton kernels"). Forward: one causal pass `(q, k, v)`. Backward, with
`do` and `dR` (the gradient of the leaving states):

    dq = causal     pass(a=do, b=v,  c=k;  entering R^T)      + dlam (its per-level row dots with q)
    dv = anticausal pass(a=k,  b=q,  c=do; entering dR / scale) -> dR0 = scale * leaving state
    dk = anticausal pass(a=v,  b=do, c=q;  entering dR^T / scale)
    dg = reverse_cumsum_within_sequence(q . dq - k . dk) + <dR, R> at the last token

The dg line is linear attention's identity, unchanged by the level weights: `lam` does not depend on
g, every pair's weight is `lam[t, level] exp(G_t - G_s)`, so `dL/dG_t` is the sum of its pair terms
as a query (`q_t . dq_t`) minus those as a key (`k_t . dk_t`).
"""
import torch
import torch.nn.functional as F

from polyattn.ops.loglinear.state import LogLinearState, fenwick_carry, occupied_levels
from polyattn.ops.triton.plan import get_config, reverse_cumsum, sequence_lengths
from polyattn.ops.triton.precision import check_kernel_inputs

from .level_pass import level_pass


def _flatten(tensors, B: int, T: int):
    """`[B, T, H, ...]` -> `[B*T, H, ...]` contiguous (None passes through)."""
    return tuple(None if x is None else x.reshape(B * T, *x.shape[2:]).contiguous() for x in tensors)


def _levels_dim(L: int, C: int) -> int:
    """NLC: the chunk-levels of the level pass's state for `L` levels and chunk size C."""
    return max(L - C.bit_length(), 1)


@torch.library.custom_op("polyattn::loglinear_attn_forward", mutates_args=())
def loglinear_attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, g: torch.Tensor | None,
    r0: torch.Tensor | None, position: torch.Tensor, scale: float, seq_lens: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward pass as a custom op: `(o [B, T, H, V], R [N, H, NLC, K, V] fp32)`, the states
    leaving the pass (level_pass.py)."""
    B, T, H, K = q.shape
    qf, kf, vf, lamf, gf = _flatten((q, k, v, lam, g), B, T)
    o, R, _, _ = level_pass(qf, kf, vf, gf, lamf, position, tuple(seq_lens), scale=scale, reverse=False, initial_state=r0)
    return o.view(B, T, H, v.shape[-1]), R  # [B*T, H, V] -> [B, T, H, V]


@loglinear_attn_forward.register_fake
def _(q, k, v, lam, g, r0, position, scale, seq_lens):
    B, T, H, K = q.shape
    NLC = _levels_dim(lam.shape[-1], get_config().chunk_size)
    return v.new_empty(B, T, H, v.shape[-1]), q.new_empty(len(seq_lens), H, NLC, K, v.shape[-1], dtype=torch.float32)


@torch.library.custom_op("polyattn::loglinear_attn_backward", mutates_args=())
def loglinear_attn_backward(
    do: torch.Tensor, dR: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lam: torch.Tensor, g: torch.Tensor | None, r0: torch.Tensor | None, position: torch.Tensor,
    R: torch.Tensor, scale: float, seq_lens: list[int], want_dg: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three backward passes as a custom op: `(dq, dk, dv, dlam, dg, dR0)`; dg without want_dg
    and dR0 without r0 are empty [0] tensors."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    seq_lens = tuple(seq_lens)
    qf, kf, vf, lamf, gf, dof = _flatten((q, k, v, lam, g, do), B, T)
    dRs = dR / scale if dR is not None else None  # the reverse states' units
    dq, _, q_dq, dlam = level_pass(
        dof, vf, kf, gf, lamf, position, seq_lens, scale=scale, reverse=False,
        initial_state=r0.transpose(-1, -2) if r0 is not None else None, dot_x=qf, want_dlam=True,
    )
    dv, dR0, _, _ = level_pass(kf, qf, dof, gf, lamf, position, seq_lens, scale=scale, reverse=True, initial_state=dRs)
    dk, _, k_dk, _ = level_pass(
        vf, dof, qf, gf, lamf, position, seq_lens, scale=scale, reverse=True,
        initial_state=dRs.transpose(-1, -2) if dRs is not None else None, dot_x=kf if want_dg else None,
    )
    empty = q.new_empty(0, dtype=torch.float32)
    dg = empty
    if want_dg:
        db = q_dq - k_dk  # [B*T, H]
        if dR is not None:
            ends = torch.tensor(seq_lens, device=db.device).cumsum(0) - 1  # [N]
            db = db.index_add(0, ends, (dR * R).sum((-1, -2, -3)))  # [N, H, NLC, K, V] -> [N, H]
        dg = reverse_cumsum(db, seq_lens).view(B, T, H).to(g.dtype)  # [B*T, H] -> [B, T, H]
    dR0 = dR0 * scale if r0 is not None else empty
    return dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, H, V), dlam.view(lam.shape).to(lam.dtype), dg, dR0


@loglinear_attn_backward.register_fake
def _(do, dR, q, k, v, lam, g, r0, position, R, scale, seq_lens, want_dg):
    empty = q.new_empty(0, dtype=torch.float32)
    dg = g.new_empty(g.shape) if want_dg else empty
    dR0 = r0.new_empty(r0.shape, dtype=torch.float32) if r0 is not None else empty
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), lam.new_empty(lam.shape), dg, dR0


def _setup_context(ctx, inputs, output):
    q, k, v, lam, g, r0, position, scale, seq_lens = inputs
    ctx.save_for_backward(q, k, v, lam, g, r0, position, output[1])
    ctx.scale, ctx.seq_lens = scale, seq_lens


def _backward(ctx, do, dR):
    q, k, v, lam, g, r0, position, R = ctx.saved_tensors
    want_dg = g is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dlam, dg, dR0 = loglinear_attn_backward(
        do.contiguous(), dR, q, k, v, lam, g, r0, position, R, ctx.scale, ctx.seq_lens, want_dg,
    )
    return dq, dk, dv, dlam, dg if want_dg else None, dR0 if r0 is not None else None, None, None, None


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


def first_chunk_reads(q, g, lam, low, position, starts, lengths, *, scale, C):
    """The reads of an initial state's in-chunk groups by the rest of their chunk: rows `j` of a
    sequence with `P + j` in the chunk of `P` (only when `P mod C > 0`), group `l` at level
    `max(l, level(P + j, P - 1))` (the groups are nested). Returns `(rows [N, C] token indices,
    real [N, C], reads [N, C, H, V] fp32)`."""
    c = C.bit_length() - 1
    L = lam.shape[-1]
    j = torch.arange(C, device=q.device)
    r0 = position % C  # [N]
    real = (j[None] < C - r0[:, None]) & (j[None] < lengths[:, None]) & (r0[:, None] > 0)  # [N, C]
    rows = torch.where(real, starts[:, None] + j, 0)  # [N, C]
    qj = torch.where(real[..., None, None], q[rows].float(), 0.0)  # [N, C, H, K]
    G = torch.zeros(qj.shape[:3], device=q.device) if g is None else torch.cumsum(torch.where(real[..., None], g[rows].float(), 0.0), 1)  # [N, C, H]
    m = bit_length((position[:, None] + j) ^ (position[:, None] - 1).clamp(min=0), c + 1)  # [N, C]: level(P + j, P - 1)
    group = torch.maximum(torch.arange(c + 1, device=q.device)[None, None], m[..., None]).clamp(max=L - 1)  # [N, C, c + 1]
    w = torch.gather(lam[rows].float(), -1, group[:, :, None].expand(-1, -1, q.shape[1], -1))  # [N, C, H, c + 1]
    qt = qj * (torch.exp(G) * scale)[..., None]  # [N, C, H, K]
    reads = torch.einsum("njhl,njhk,nhlkv->njhv", w, qt, low)  # [N, C, H, V]
    return rows, real, reads


def last_chunk_levels(k, v, g, low, position, starts, lengths, C):
    """Fenwick levels `0..c` of the final state `[N, H, c + 1, K, V]`: the keys of the last query's
    chunk at `level(E - 1, s)`, carried to `E - 1`, plus the initial in-chunk groups when the
    sequence never left their chunk (at `max(l, level(E - 1, P - 1))`)."""
    c = C.bit_length() - 1
    E = position + lengths  # [N]
    n1 = torch.div(E - 1, C, rounding_mode="floor")  # [N]
    apos = n1[:, None] * C + torch.arange(C, device=k.device)  # [N, C]
    real = (apos >= position[:, None]) & (apos < E[:, None])  # [N, C]
    rows = torch.where(real, starts[:, None] + apos - position[:, None], 0)  # [N, C]
    kj, vj = (torch.where(real[..., None, None], x[rows].float(), 0.0) for x in (k, v))  # [N, C, H, D]
    gj = torch.zeros(kj.shape[:3], device=k.device) if g is None else torch.where(real[..., None], g[rows].float(), 0.0)  # [N, C, H]
    to_end = torch.flip(torch.cumsum(torch.flip(gj, [1]), 1), [1]) - gj  # [N, C, H]: g_{s+1} + ... (padding rows are 0)
    lev = bit_length((E[:, None] - 1).clamp(min=0) ^ apos.clamp(min=0), c + 1)  # [N, C]
    onehot = (lev[..., None] == torch.arange(c + 1, device=k.device)).float() * real[..., None]  # [N, C, c + 1]
    levels = torch.einsum("njl,njh,njhk,njhv->nhlkv", onehot, torch.exp(to_end), kj, vj)  # [N, H, c + 1, K, V]
    if low is None:
        return levels
    same = ((position // C == n1) & (position % C > 0)).float()  # [N]: the sequence stayed in its first chunk
    m_end = bit_length((E - 1).clamp(min=0) ^ (position - 1).clamp(min=0), c + 1)  # [N]
    to = torch.maximum(torch.arange(c + 1, device=k.device)[None], m_end[:, None])  # [N, c + 1]
    move = (to[..., None] == torch.arange(c + 1, device=k.device)).float() * same[:, None, None]  # [N, c + 1 (from), c + 1 (to)]
    total = torch.exp(gj.sum(1))  # [N, H]: the sequence's whole decay (it is inside this chunk)
    return levels + torch.einsum("nlm,nh,nhlkv->nhmkv", move, total, low)


def blocks_to_fenwick(R: torch.Tensor, low_levels: torch.Tensor, position: torch.Tensor, lengths: torch.Tensor, C: int, L: int):
    """The final `LogLinearState` levels `[N, H, L, K, V]`: levels `0..c` from `last_chunk_levels`,
    level `c + 1 + ell` the leaving state `R[ell]` where bit `ell` of the last chunk index is set
    (the first half of that block: chunk-level `ell` of the last query), empty elsewhere."""
    NLC = R.shape[2]
    n1 = torch.div(position + lengths - 1, C, rounding_mode="floor")  # [N]
    bits = (n1[:, None] >> torch.arange(NLC, device=R.device)) & 1  # [N, NLC]
    high = torch.where(bits[:, None, :, None, None] == 1, R, 0.0)  # [N, H, NLC, K, V]
    return torch.cat([low_levels, high], dim=2)[:, :, :L]  # [N, H, c + 1 + NLC, K, V] -> [N, H, L, K, V]


def loglinear_attn_fused(q, k, v, lam, g=None, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Triton form of `loglinear_attn` with `beta=None` (inputs already validated, scale resolved).

    q, k: [B, T, H, K]; v: [B, T, H, V]; lam: [B, T, H, L]; g: [B, T, H] or None; initial_state:
    `LogLinearState` with levels [N, H, L, K, V]; cu_seqlens: int [N + 1] with B == 1, handled
    natively (one host read of the offsets, none of the positions). Returns `(o [B, T, H, V] in q's
    dtype, LogLinearState or None)`.
    """
    check_kernel_inputs(q)
    B, T, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    C = get_config().chunk_size
    NLC = _levels_dim(L, C)
    seq_lens = sequence_lengths(cu_seqlens, B, T)
    N = len(seq_lens)
    lengths = torch.tensor(seq_lens, device=q.device)  # [N]
    starts = lengths.cumsum(0) - lengths  # [N]
    if initial_state is not None:
        position = initial_state.position
        occupied = occupied_levels(position, L)[:, None, :, None, None]  # [N, 1, L, 1, 1]
        levels = torch.where(occupied, initial_state.levels.float(), 0.0)  # levels that hold no keys at the position are not read
    else:
        position = torch.zeros(N, dtype=torch.int64, device=q.device)
    if q.numel() == 0:
        o = v.new_zeros(B, T, H, V, dtype=q.dtype)
        if not output_final_state:
            return o, None
        final = levels if initial_state is not None else q.new_zeros(N, H, L, K, V, dtype=torch.float32)
        return o, LogLinearState(final, position + lengths)
    r0, low = (None, None) if initial_state is None else fenwick_to_blocks(levels, position, C, NLC)
    o, R = loglinear_attn_forward(q, k, v, lam, g, r0, position, scale, list(seq_lens))
    flat = lambda x: None if x is None else x.reshape(B * T, *x.shape[2:])  # noqa: E731  [B, T, H, ...] -> [B*T, H, ...]
    if initial_state is not None:
        rows, real, reads = first_chunk_reads(flat(q), flat(g), flat(lam), low, position, starts, lengths, scale=scale, C=C)
        o = flat(o).float().index_add(0, rows[real], reads[real]).to(q.dtype).view(B, T, H, V)
    if not output_final_state:
        return o, None
    low_levels = last_chunk_levels(flat(k), flat(v), flat(g), low, position, starts, lengths, C)
    final = blocks_to_fenwick(R, low_levels, position, lengths, C, L)
    if initial_state is not None:
        final = torch.where((lengths == 0)[:, None, None, None, None], levels, final)  # an empty sequence keeps its state
    return o, LogLinearState(final, position + lengths)
