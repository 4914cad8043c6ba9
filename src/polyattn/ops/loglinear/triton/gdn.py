"""The forward of log-linear Gated DeltaNet (`beta` given) on Triton: the delta rule's WY factors, then
two kernels.

Per chunk of C = 2^c tokens (ops/loglinear/chunk.py has the PyTorch form), with `A = scale Q K^T ⊙ exp(D)`
(causal, diagonal included), `Tinv = M^{-1}` and the WY factors `W = Tinv diag(β exp(gc)) K`,
`Ū = Tinv diag(β) V` of the delta rule (ops/delta/triton/wy.py):

    intra  O = ((A Tinv diag(β)) ⊙ lam[t, level(i, j)]) V          the level-masked attention of the chunk
    query  q̃ = diag(exp(gc)) scale Q - A W                           what reads a state entering the chunk

Between chunks, chunk-level `ell` (pairs of chunks `m < n` in the same aligned block of `2^(ell+1)`
chunks, `m` in its first half, `n` in its second; ops/loglinear/README.md, "Chunk factorisation") is a
delta rule of its own over the whole sequence: its state `h` restarts at each block, every chunk applies
its transition, the first half's chunks write and the second half's read,

    read   O += lam[t, c + 1 + ell] (q̃ h)                            where bit ell of the chunk index is 1
    carry  h <- exp(gc_last) h + K̃^T (Ū [bit ell is 0] - W h),      K̃_s = exp(g_{s+1} + ... + g_last) k_s

(the transition of every token applies to every state alive across it, written or not). So the levels
are `L - c - 1` delta rules sharing their inputs and W, Ū: `gdn_chunk_kernel` forms the intra block
and q̃ for every chunk in parallel, `gdn_levels_kernel` walks each sequence's chunks once per value
tile, every level in turn, its states in a global fp32 buffer (`[N, H, NLC, K, V]`, L2-resident) since
Triton cannot index registers by level, and adds the reads to the intra block in registers: one output
store per chunk, no atomics, the same bits every run. The buffer enters holding the initial chunk-level
states (function.py, `fenwick_to_blocks`) and leaves holding each level's state after the last chunk, the
level pass's `R` (level_pass.py), from which function.py forms the final state. Chunks lie on the absolute
grid of each sequence's start position (`plan.grid_chunk_table`).

A NaN or Inf in a token's k, v, β or g (the WY stage's `firsts`) makes every later output NaN and no
earlier one (the intra rows from it on are NaN, the states after its chunk are NaN); one in q reaches
only its own row. `gdn_forward_ref` is the PyTorch twin of both kernels.
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.common.fenwick import level_table
from polyattn.ops.delta.triton.forward import chunk_program, chunk_scores, sequence_tile
from polyattn.ops.delta.triton.function import fp32_dot
from polyattn.ops.delta.triton.wy import wy_factors, wy_solve
from polyattn.ops.triton.decay import chunk_decay, chunk_suffix
from polyattn.ops.triton.plan import block, get_config, grid_chunk_table, segment_table
from polyattn.ops.triton.precision import (
    dot_f32, mma_fp32, mma_left_fp32, mma_right_fp32, nan_rows_from, to_output, zero_rows_from,
)

from .level_pass import bit_length, intra_levels


@triton.jit
def gdn_chunk_kernel(
    q, k, v, g, beta, lam, w, t_inv, firsts, qt, o_intra, chunks, scale, H, K, V, L,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, F32: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """grid: (num_chunks, H). One chunk of one head: q̃ [C, K] (stored fp32) and the intra block
    [C, V] (stored fp32, value tiles of BV in turn) from the score tile A [C, C], the chunk's rows of
    Tinv [C, C] and W [C, K]. The rows from the chunk's first non-finite token (`firsts`) on are NaN."""
    i_ch, i_h, _, _, o_t, t, m_t = chunk_program(chunks, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    row_k = (t * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK]
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
    b_att = chunk_scores(b_q, b_k, b_g, b_gc, b_last, scale, F32)  # [C, C]: A, 0 above the diagonal
    b_w = tl.load(w + row_k, mask=m_tk, other=0.0)  # [C, BK] fp32
    b_qt = b_q.to(tl.float32) * (tl.exp2(b_gc) * scale)[:, None] - mma_fp32(b_att, b_w, b_q.dtype, F32, FP32_DOT)  # [C, C] @ [C, BK]
    tl.store(qt + row_k, b_qt, mask=m_tk)
    b_ti = tl.load(t_inv + (t * H + i_h)[:, None] * C + o_t[None, :], mask=m_t[:, None], other=0.0)  # [C, C] fp32, lower
    b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    b_wa = mma_fp32(b_att, b_ti, b_q.dtype, F32, FP32_DOT) * b_beta[None, :]  # [C, C] @ [C, C]: A Tinv diag(β)
    lut = intra_levels(C, LOG_C, tl.load(chunks + i_ch * 4 + 2))  # [C, C] at the chunk's offsets on the grid
    m_w = m_t[:, None] & (o_t[:, None] >= o_t[None, :]) & (lut < L)
    b_lam = tl.load(lam + (t * H + i_h)[:, None] * L + lut, mask=m_w, other=0.0).to(tl.float32)  # [C, C]: lam[t, level(i, j)]
    b_wa = tl.where(m_w, b_wa * b_lam, 0.0)  # [C, C]
    first = tl.load(firsts + i_ch * H + i_h)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        row_v = (t * H + i_h)[:, None] * V + o_v[None, :]  # [C, BV]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = zero_rows_from(tl.load(v + row_v, mask=m_tv, other=0.0), first)  # [C, BV]
        b_o = nan_rows_from(mma_left_fp32(b_wa, b_v, F32), first)  # [C, C] @ [C, BV] -> [C, BV]
        tl.store(o_intra + row_v, b_o, mask=m_tv)


@triton.jit
def gdn_levels_kernel(
    k, g, w, u_bar, qt, lam, firsts, o_intra, out, state, seqs, chunks, cu_chunks, pos, H, K, V, L, NLC,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, F32: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """grid: (cdiv(V, BV), N, H). One sequence, head and value tile, the sequence starting at the
    absolute position `pos[n]`, its chunks the rows `cu_chunks[n]..` of the grid table `chunks`: per
    chunk `a` (absolute index), for each chunk-level that a chunk of the sequence can read
    (`ell < bit_length(last chunk index)`), the products `W h` [C, BK] @ [BK, BV], the read `q̃ h`
    where bit ell of `a` is set and the carry `K̃^T (.)` [BK, C] @ [C, BV]; the level's state tile
    [BK, BV] is loaded from and stored to `state` (which enters holding the initial states; zero at
    a block's first chunk after the sequence's first), the output tile (intra block + reads) stored once."""
    i_n, i_h, bos, eos, c0, o_k, m_k, o_v, m_v, m_s, state_tile = sequence_tile(seqs, cu_chunks, K, V, BK, BV)
    o_t = tl.arange(0, C)
    P = tl.load(pos + i_n).to(tl.int32)  # positions below 2^31
    n0 = P // C
    n1 = (P + (eos - bos) - 1) // C  # the last chunk's absolute index
    NL = tl.minimum(bit_length(n1), NLC)  # chunk-levels some chunk reads
    p_level = state + ((i_n * H + i_h) * NLC).to(tl.int64) * K * V + state_tile  # [BK, BV] of level 0
    for i in range(0, n1 - n0 + 1):
        a = n0 + i
        t = tl.load(chunks + (c0 + i) * 4) + o_t
        m_t = t < tl.load(chunks + (c0 + i) * 4 + 1)
        row_k = (t * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK]
        m_tk = m_t[:, None] & m_k[None, :]
        row_v = (t * H + i_h)[:, None] * V + o_v[None, :]  # [C, BV]
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(w + row_k, mask=m_tk, other=0.0)  # [C, BK] fp32
        b_qt = tl.load(qt + row_k, mask=m_tk, other=0.0)  # [C, BK] fp32
        b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
        b_u = tl.load(u_bar + row_v, mask=m_tv, other=0.0)  # [C, BV] fp32
        b_o = tl.load(o_intra + row_v, mask=m_tv, other=0.0)  # [C, BV] fp32
        b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
        b_wk = tl.exp2(chunk_suffix(b_g, b_gc, b_last, F32))  # [C]: exp(gc_last - gc)
        bad = tl.load(firsts + (c0 + i) * H + i_h) < C  # a non-finite token in the chunk
        for ell in range(0, NL):
            p_s = p_level + ell * K * V
            # [BK, BV]; a block's first chunk reads nothing, but the sequence's first chunk reads what entered
            # (an initial state's keys in that chunk join its writes: function.py, fenwick_to_blocks)
            m_h = m_s & (((o_k[:, None] * 0 + a) % (2 << ell) != 0) | (i == 0))
            b_h = tl.load(p_s, mask=m_h, other=0.0)  # [BK, BV]
            b_x = mma_fp32(b_w, b_h, b_k.dtype, F32, FP32_DOT)  # [C, BK] @ [BK, BV] -> [C, BV]
            if ((a >> ell) & 1) == 1:  # second half: read
                b_lam = tl.load(lam + (t * H + i_h) * L + (LOG_C + 1 + ell), mask=m_t, other=0.0).to(tl.float32)  # [C]
                b_o += mma_fp32(b_qt, b_h, b_k.dtype, F32, FP32_DOT) * b_lam[:, None]  # [C, BK] @ [BK, BV]
                b_x = -b_x
            else:  # first half: write
                b_x = b_u - b_x
            b_h = b_h * tl.exp2(b_last) + mma_right_fp32(tl.trans(b_k), b_x * b_wk[:, None], F32)  # [BK, C] @ [C, BV]
            b_h += tl.where(bad, float("nan"), 0.0)
            tl.store(p_s, b_h, mask=m_s)
        tl.store(out + row_v, to_output(b_o, out.dtype.element_ty, F32), mask=m_tv)  # downcast: output dtype


def gdn_forward_ref(q, k, v, g, beta, lam, w, u_bar, t_inv, seq_lens: tuple, positions: list, *, scale, chunk_size, r0=None):
    """PyTorch twin of `gdn_chunk_kernel` and `gdn_levels_kernel` (float64, finite inputs): `(o [N_tok, H, V],
    state [N, H, NLC, K, V])` from the kernels' inputs (`w, u_bar, t_inv` of the WY stage on the grid's
    chunks), sequence n starting at the absolute position `positions[n]` (host ints) with the entering
    chunk-level states `r0 [N, H, NLC, K, V]` (or none); the state's levels that no chunk reads stay as
    they entered."""
    N_tok, H, K = q.shape
    V, L, C = v.shape[-1], lam.shape[-1], chunk_size
    c = C.bit_length() - 1
    NLC = max(L - c - 1, 1)
    q, k, v, beta, lam, w, u_bar, t_inv = (x.double() for x in (q, k, v, beta, lam, w, u_bar, t_inv))
    g = torch.zeros_like(beta) if g is None else g.double()
    lut = level_table(C, device=q.device)  # [C, C], -1 above the diagonal
    o = torch.zeros(N_tok, H, V, dtype=torch.float64, device=q.device)
    states, bos = [], 0
    for n, (length, P) in enumerate(zip(seq_lens, positions)):
        n0, n1 = P // C, (P + length - 1) // C
        NL = min(n1.bit_length(), NLC)
        h = torch.zeros(NLC, H, K, V, dtype=torch.float64, device=q.device) if r0 is None else r0[n].double().transpose(0, 1).clone()
        for a in range(n0, n1 + 1):
            s, e = bos + max(a * C - P, 0), bos + min((a + 1) * C - P, length)
            m, off = e - s, (P % C if a == n0 else 0)
            qc, kc, vc, wc, uc = (x[s:e].transpose(0, 1) for x in (q, k, v, w, u_bar))  # [H, m, D]
            gc = torch.cumsum(g[s:e].t(), -1)  # [H, m]
            att = scale * (qc @ kc.transpose(-1, -2)) * torch.exp(gc[:, :, None] - gc[:, None, :]).tril()  # [H, m, m]
            qt = scale * torch.exp(gc)[..., None] * qc - att @ wc  # [H, m, K]
            tinv = t_inv[s:e, :, :m].transpose(0, 1)  # [H, m, m]
            lam_c = lam[s:e].transpose(0, 1)  # [H, m, L]
            lut_c = lut[off : off + m, off : off + m]  # [m, m]: levels of the rows' offsets on the grid
            lam_in = torch.gather(lam_c, -1, lut_c.clamp(min=0).expand(H, m, m)) * (lut_c >= 0)  # [H, m, m]
            oc = ((att @ tinv) * beta[s:e].t()[:, None, :] * lam_in) @ vc  # [H, m, V]
            kd = torch.exp(gc[:, -1:] - gc)[..., None] * kc  # [H, m, K]: K̃
            for ell in range(NL):
                if a % (2 << ell) == 0 and a > n0:
                    h[ell] = 0
                x = wc @ h[ell]  # [H, m, V]
                if (a >> ell) & 1:
                    oc = oc + lam_c[:, :, c + 1 + ell, None] * (qt @ h[ell])
                    x = -x
                else:
                    x = uc - x
                h[ell] = torch.exp(gc[:, -1])[:, None, None] * h[ell] + kd.transpose(-1, -2) @ x
            o[s:e] = oc.transpose(0, 1)
        states.append(h.transpose(0, 1))  # [NLC, H, K, V] -> [H, NLC, K, V]
        bos += length
    return o, torch.stack(states)


def gdn_forward(q, k, v, g, beta, lam, seq_lens: tuple, position, *, scale, r0=None, out_dtype=None):
    """The forward from flattened tokens (q, k: [N_tok, H, K]; v: [N_tok, H, V]; g, beta: [N_tok, H], g
    may be None; lam: [N_tok, H, L]; all contiguous), sequence n starting at the absolute position
    `position[n]` (device int64) with the entering chunk-level states `r0 [N, H, NLC, K, V]` fp32 (or
    none). Returns `(o [N_tok, H, V] in out_dtype (default q's), R [N, H, NLC, K, V] fp32 (each
    chunk-level's state after the last chunk), t_inv [N_tok, H, C], w [N_tok, H, K], qt [N_tok, H, K],
    fp32: the WY stage's inverses and factor and q̃, for the edge terms of function.py)`."""
    config = get_config()
    N_tok, H, K = q.shape
    V, L, C = v.shape[-1], lam.shape[-1], config.chunk_size
    LOG_C = C.bit_length() - 1
    N, NLC = len(seq_lens), max(L - LOG_C - 1, 1)
    chunks = grid_chunk_table(seq_lens, position, C)
    seqs = segment_table(seq_lens, 1, C, q.device)[0]
    t_inv, firsts = wy_solve(k, beta, g, chunk_size=C, chunks=chunks, num_warps=config.num_warps)
    w, u_bar = wy_factors(k, v, beta, g, t_inv, firsts, chunks=chunks, num_warps=config.num_warps)
    BK, F32, FP32_DOT = block(K), dot_f32(q.dtype), fp32_dot(config)
    qt = torch.empty(N_tok, H, K, dtype=torch.float32, device=q.device)
    o_intra = torch.empty(N_tok, H, V, dtype=torch.float32, device=q.device)
    gdn_chunk_kernel[(chunks[2], H)](
        q, k, v, g, beta, lam, w, t_inv, firsts, qt, o_intra, chunks[0], scale, H, K, V, L,
        C=C, LOG_C=LOG_C, BK=BK, BV=min(block(V), config.delta_out_block_v), USE_G=g is not None, F32=F32,
        FP32_DOT=FP32_DOT, num_warps=config.delta_chunk_warps, num_stages=config.num_stages,
    )
    R = torch.zeros(N, H, NLC, K, V, dtype=torch.float32, device=q.device) if r0 is None else r0.float().contiguous().clone()
    out = torch.empty(N_tok, H, V, dtype=out_dtype or q.dtype, device=q.device)
    BV = min(block(V), config.gdn_block_v)
    gdn_levels_kernel[(triton.cdiv(V, BV), N, H)](
        k, g, w, u_bar, qt, lam, firsts, o_intra, out, R, seqs, chunks[0], chunks[1], position, H, K, V, L, NLC,
        C=C, LOG_C=LOG_C, BK=BK, BV=BV, USE_G=g is not None, F32=F32, FP32_DOT=FP32_DOT,
        num_warps=config.gdn_num_warps, num_stages=config.num_stages,
    )
    return out, R, t_inv, w, qt
