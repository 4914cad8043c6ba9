"""Chunkwise log-linear attention: a dense level-masked block inside chunks, per-level states between them.

Chunks of ``C = 2^c`` tokens are aligned to absolute positions, so inside a chunk the level of a pair
depends only on the in-chunk offsets (a ``C×C`` table, levels ``0..c``), and across chunks it is
``c + 1 + ell`` with the chunk-level ``ell = bit_length(n XOR m) - 1`` of the absolute chunk indices
(ops/loglinear/README.md, "Chunk factorisation"). No ``T×T`` table is built. Per chunk (local inclusive
cumulative log-decay ``gc``, ``D = exp(segsum g) ⊙ causal``, ``A = scale Q K^T ⊙ D``)::

    Mamba-2 (beta=None):  W = A,                q̃ = exp(gc) ⊙ scale Q,     U = V,  w = 0
    GDN (beta given):     W = A M^{-1} diag(β), q̃ = exp(gc) ⊙ scale Q - A w,
                          U = M^{-1} diag(β) V, w = M^{-1} diag(β) (K ⊙ exp(gc))        (M as delta_rule_system)
    O_intra = (W ⊙ lam[t, LUT[t, s]]) V                                                   (the level-masked W)

``W`` is the complete attention matrix restricted to the chunk, so the mask is applied after the inverse.
Between chunks one K×V state per chunk-level, ``H[ell]``, holds the keys of earlier chunks that sit in
chunk-level ``ell`` of the current chunk, carried to the chunk's start (the single-pass scheme,
ops/loglinear/README.md, "Chunk algorithm")::

    O_n  += Σ_ell lam[t, c + 1 + ell] q̃_t^T H[ell]                                       (read)
    H[ell] <- exp(gc_last) H[ell] - K̃^T (w H[ell])  for every ell,   K̃_s = exp(g_{s+1} + … + g_last) k_s   (carry through chunk n)
    [new, H] <- fenwick_carry([K̃^T U, H], n + 1)                                          (chunk n joins chunk-level ctz(n+1))

i.e. the token recurrence of :mod:`recurrent` run over chunks with chunk n as the incoming "level -1".
An initial state at position ``P`` starts the first chunk at ``P - P mod C`` (the first ``P mod C`` rows
are empty tokens: ``k = v = q = 0``, ``g = 0``, ``β = 0``, an identity transition); its levels above ``c``
are the first ``H``; its levels ``0..c`` (keys of the first chunk when ``P mod C > 0``) are read as in
naive (3), at level ``max(l, level(t, P - 1))``, and join the first chunk's contribution. The last chunk is
padded the same way; the final state is read off the last chunk at its last real row.
Cost per head: intra ``O(T·C·(K + V))``, inter ``O(T·K·V·log(T/C))``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from polyattn.ops.common import (
    causal_matmul,
    causal_scores,
    compute_dtype,
    exp_segsum,
    heads_chunks,
    heads_unchunk,
    level,
    level_table,
    suffix_sum,
)
from polyattn.ops.chunked import chunk_inputs, delta_rule_system
from polyattn.ops.loglinear.state import LogLinearState, check_lam_levels, empty_batch, fenwick_carry, initial_levels, state_positions


def _front_pad(x, r):
    """``r`` empty tokens before ``x: [B, T, ...]`` (None passes through)."""
    if x is None or r == 0:
        return x
    return F.pad(x, [0, 0] * (x.dim() - 2) + [r, 0])  # [B, T, ...] -> [B, r + T, ...]


def _carry_through(X, decay, Kdec, w):
    """Carry states ``X: [B, H, l, K, V]`` through one chunk: ``exp(gc_last) X - K̃^T (w X)`` (no w: decay only)."""
    decayed = decay[:, :, None, None, None] * X
    if w is None:
        return decayed
    wX = torch.einsum("bhck,bhlkv->bhlcv", w, X)  # [B, H, l, C, V]
    return decayed - torch.einsum("bhck,bhlcv->bhlkv", Kdec, wX)  # [B, H, l, K, V]


class ChunkParts(NamedTuple):
    """The per-chunk pieces of the table above for every chunk at once (chunked ``[B, H, N, C, ...]``)."""

    qc: torch.Tensor  # scale q
    kc: torch.Tensor
    vc: torch.Tensor
    lamc: torch.Tensor  # [B, H, N, C, Lp]
    bc: torch.Tensor | None  # beta
    log_decay: torch.Tensor  # [B, H, N]: gc_last, the chunk's total log-decay
    decay: torch.Tensor  # [B, H, N]: exp(gc_last)
    Kdec: torch.Tensor  # K̃
    qt: torch.Tensor  # q̃
    U: torch.Tensor
    w: torch.Tensor | None
    Minv: torch.Tensor | None
    lut: torch.Tensor  # [C, C] level table
    intra: torch.Tensor  # [B, H, N, C, V]: (W ⊙ lam[t, LUT[t, s]]) V


def chunk_parts(q, k, v, lam, g, beta, r0, *, scale, C, Lp) -> ChunkParts:
    """``r0`` empty rows before the inputs, lam padded to ``Lp`` levels, then every chunk's pieces (one dtype)."""
    dt = q.dtype
    B, _, H, _ = q.shape
    q, k, v, lam, g, beta = (_front_pad(x, r0) for x in (q, k, v, lam, g, beta))
    lam = F.pad(lam, [0, Lp - lam.shape[-1]])  # [B, r0 + T, H, Lp]
    qc, kc, vc, gl = chunk_inputs(q, k, v, g, scale, C)  # [B, H, N, C, D]; g: [B, H, N, C]
    lamc = heads_chunks(lam, C)  # [B, T', H, Lp] -> [B, H, N, C, Lp]
    N = qc.shape[2]
    gc = torch.cumsum(gl, dim=-1)  # [B, H, N, C]
    decay = torch.exp(gc[..., -1])  # [B, H, N]
    Kdec = kc * torch.exp(suffix_sum(gl))[..., None]  # [B, H, N, C, K]: exp(g_{s+1} + ... + g_last) k_s
    qt = torch.exp(gc)[..., None] * qc  # [B, H, N, C, K] (qc carries the scale)
    bc = Minv = w = None
    if beta is None:
        W = causal_scores(qc @ kc.transpose(-1, -2), exp_segsum(gl))  # [B, H, N, C, C]
        U = vc
    else:
        bc = heads_chunks(beta.to(dt), C)  # [B, T', H] -> [B, H, N, C]
        D, M = delta_rule_system(kc, bc, gl)  # [B, H, N, C, C] each
        A = causal_scores(qc @ kc.transpose(-1, -2), D)  # [B, H, N, C, C]
        eye = torch.eye(C, dtype=dt, device=q.device)
        Minv = torch.linalg.solve_triangular(M, eye.expand_as(M), upper=False, unitriangular=True)  # [B, H, N, C, C]
        W = causal_matmul(A, Minv) * bc[..., None, :]  # [B, H, N, C, C]
        w = causal_matmul(Minv, bc[..., None] * torch.exp(gc)[..., None] * kc)  # [B, H, N, C, K]
        U = causal_matmul(Minv, bc[..., None] * vc)  # [B, H, N, C, V]
        qt = qt - causal_matmul(A, w)  # [B, H, N, C, K]
    lut = level_table(C, device=q.device)  # [C, C], -1 above the diagonal
    lam_intra = torch.gather(lamc, -1, lut.clamp(min=0).expand(B, H, N, C, C))  # [B, H, N, C, C]: lam[t, LUT[t, s]]
    intra = causal_matmul(causal_scores(W, lam_intra), vc)  # [B, H, N, C, C] @ [B, H, N, C, V] -> [B, H, N, C, V]
    return ChunkParts(qc, kc, vc, lamc, bc, gc[..., -1], decay, Kdec, qt, U, w, Minv, lut, intra)


def _chunk_at(q, k, v, lam, g, beta, levels0, P, *, scale, C, output_final_state):
    """All sequences of the batch start at the same absolute position ``P`` (host int)."""
    dt = q.dtype
    B, T, H, K = q.shape
    L = lam.shape[-1]
    c = C.bit_length() - 1
    Lp = max(L, c + 1)  # levels 0..c exist in every chunk table (beyond L only for padding rows)
    r0 = P % C
    first = P // C  # absolute index of the first chunk
    if P > 0 and r0 == 0:
        levels0 = fenwick_carry(levels0, torch.full((B,), P, dtype=torch.int64, device=q.device))  # view of query P
    levels0 = F.pad(levels0, [0, 0, 0, 0, 0, Lp - L])  # [B, H, L, K, V] -> [B, H, Lp, K, V]
    low, Hs = levels0[:, :, : c + 1], levels0[:, :, c + 1 :]  # keys of the first chunk; chunk-levels
    has_low = P > 0 and r0 > 0

    p = chunk_parts(q, k, v, lam, g, beta, r0, scale=scale, C=C, Lp=Lp)
    qt, lamc, Kdec, U, w, decay, vc, bc, Minv, lut = p.qt, p.lamc, p.Kdec, p.U, p.w, p.decay, p.vc, p.bc, p.Minv, p.lut
    o, N = p.intra, qt.shape[2]

    if has_low:
        prev = lut[:, r0 - 1]  # [C]: level(t, P - 1) for the first chunk's rows t >= r0
        group_level = torch.maximum(torch.arange(c + 1, device=q.device)[None, :], prev[:, None])  # [C, c + 1]
        lam_low = torch.gather(lamc[:, :, 0], -1, group_level.expand(B, H, C, c + 1))  # [B, H, C, c + 1]
        reads = torch.einsum("bhck,bhlkv->bhclv", qt[:, :, 0], low)  # [B, H, C, c + 1, V]
        o_first = o[:, :, 0] + (lam_low[..., None] * reads).sum(-2)  # [B, H, C, V]
        o = torch.cat([o_first[:, :, None], o[:, :, 1:]], dim=2)

    inter = []
    for n in range(N):
        read = torch.einsum("bhck,bhlkv->bhclv", qt[:, :, n], Hs)  # [B, H, C, Lc, V]
        inter.append((lamc[:, :, n, :, c + 1 :, None] * read).sum(-2))  # [B, H, C, V]
        if n == N - 1:
            break
        w_n = None if w is None else w[:, :, n]
        Hs = _carry_through(Hs, decay[:, :, n], Kdec[:, :, n], w_n)
        new = Kdec[:, :, n].transpose(-1, -2) @ U[:, :, n]  # [B, H, K, C] @ [B, H, C, V] -> [B, H, K, V]
        if n == 0 and has_low:
            new = new + _carry_through(low, decay[:, :, 0], Kdec[:, :, 0], w_n).sum(2)
        nxt = torch.full((B,), first + n + 1, dtype=torch.int64, device=q.device)
        Hs = fenwick_carry(torch.cat([new[:, :, None], Hs], dim=2), nxt)[:, :, 1:]  # [B, H, Lc, K, V]
    o = o + torch.stack(inter, dim=2)  # N x [B, H, C, V] -> [B, H, N, C, V]
    o = heads_unchunk(o, r0 + T)[:, r0:]  # [B, H, N, C, V] -> [B, T, H, V]
    if not output_final_state:
        return o, None

    w_last = None if w is None else w[:, :, -1]
    last_row = (r0 + T - 1) % C  # padding rows after it carry by the identity
    onehot = (lut[last_row][:, None] == torch.arange(c + 1, device=q.device)).to(dt)  # [C, c + 1]
    carried_keys = Kdec[:, :, -1]  # [B, H, C, K]: row s = (A_last ⋯ A_{s+1}) k_s β_s, one key at a time (unlike U)
    if beta is not None:
        carried_keys = bc[:, :, -1, :, None] * (Minv[:, :, -1].transpose(-1, -2) @ carried_keys)  # diag(β) M^{-T} K̃
    final_low = torch.einsum("bhck,bhcv,cl->bhlkv", carried_keys, vc[:, :, -1], onehot)  # [B, H, c + 1, K, V]
    if has_low and N == 1:
        carried = _carry_through(low, decay[:, :, 0], Kdec[:, :, 0], w_last)  # [B, H, c + 1, K, V]
        to_level = torch.arange(c + 1, device=q.device).clamp(min=level(last_row, r0 - 1))  # [c + 1]: lut[last_row, r0 - 1], on the host
        final_low = final_low.index_add(2, to_level, carried)
    final_high = _carry_through(Hs, decay[:, :, -1], Kdec[:, :, -1], w_last)  # [B, H, Lc, K, V]
    final = torch.cat([final_low, final_high], dim=2)[:, :, :L]  # [B, H, Lp, K, V] -> [B, H, L, K, V]
    return o, final


def loglinear_attn_chunk(q, k, v, lam, g=None, *, beta=None, scale, initial_state=None, output_final_state=False, chunk_size=64):
    """Returns ``(o [B,T,H,V], LogLinearState | None)``; ``chunk_size`` must be a power of two."""
    return run_by_position(_chunk_at, q, k, v, lam, g, beta, scale, initial_state, output_final_state, chunk_size)


def run_by_position(at, q, k, v, lam, g, beta, scale, initial_state, output_final_state, chunk_size):
    """``at(q, k, v, lam, g, beta, levels0, P, ...)`` on the sequences whose initial states sit at each position P,
    in groups of equal position (the chunk grid is aligned to absolute positions); ``(o, LogLinearState | None)``."""
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    C = chunk_size
    if C < 1 or C & (C - 1):
        raise ValueError(f"chunk_size: expected a power of two, got {C}")
    check_lam_levels(L, initial_state, T)
    positions = state_positions(initial_state, B)  # on the host: the level grid follows absolute positions
    if B == 0:
        return empty_batch(q, v, L, output_final_state)
    levels0, position = initial_levels(initial_state, B, H, L, K, V, dt, q.device)  # [B, H, L, K, V], [B]
    tensors = [None if x is None else x.to(dt) for x in (q, k, v, lam, g, beta)]
    outputs, finals, order = [], [], []
    for P in sorted(set(positions)):
        rows = [b for b in range(B) if positions[b] == P]
        pick = (lambda x: x) if len(rows) == B else (lambda x: None if x is None else x[rows])
        o, final = at(*(pick(x) for x in tensors), pick(levels0), P, scale=scale, C=C, output_final_state=output_final_state)
        outputs.append(o)
        finals.append(final)
        order += rows
    inverse = torch.argsort(torch.tensor(order, device=q.device))  # group order -> batch order
    o = torch.cat(outputs, dim=0)[inverse].to(out_dtype)  # [B, T, H, V]
    if not output_final_state:
        return o, None
    return o, LogLinearState(torch.cat(finals, dim=0)[inverse], position + T)
