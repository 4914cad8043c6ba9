"""Custom ops, autograd and host front of KATA's Triton quadratic form (`impl="triton_parallel"`).

The kernels (forward.py, backward.py) compute the quadratic part and carry no state. An initial
state `[S | z]` enters as a *prior*, the host's bilinear read per query (state.py's augmented form),

    prior_t = exp(G_t) ψ(scale·q_t)ᵀ [S_0 | z_0]          (G_t: inclusive cumsum of g in the sequence)

which the forward kernel adds to its numerator and normaliser before the normalized read, so that
`o = (num + prior[:V]) / max(den + prior[V], eps)` is one division of the combined parts. The final
state is one write of all keys on the host, `exp(G_T) [S_0 | z_0] + Σ_s exp(G_T − G_s) ψ(k_s) [v_s | 1]ᵀ`
(fmap.write, ψ never built). Both host parts are PyTorch, so autograd differentiates them; the
backward op returns the prior's gradient `[r·do | −c]` (`prior_cotangents`' r and c) for them. A bf16/fp16
call that differentiates through a state hands the ops and the host parts one fp32 copy of q, k, v, g, so
that the gradients of both add in fp32 and are rounded once (the ops take the kernels' `dtype`).
"""
from typing import NamedTuple

import torch
import triton

from polyattn.ops.common import suffix_sum, wants_grad
from polyattn.ops.kata.feature_maps import make_feature_map
from polyattn.ops.kata.state import KataState, join_state, split_state, with_ones
from polyattn.ops.triton.decay import reset_limit_ref
from polyattn.ops.triton.plan import (
    block, chunk_table, device_lengths, get_config, kata_state_chunk, no_output, prefix_cumsum, reverse_cumsum, segment_table, sequence_lengths, sequence_starts,
)
from polyattn.ops.triton.precision import check_kernel_inputs, dot_f32

from .backward import kata_dkdv_kernel, kata_dq_kernel, row_dot_kernel
from .chunk import chunk_lengths, kata_lift_grad_kernel, kata_read_kernel, kata_states_kernel
from .forward import kata_forward_kernel
from .tiles import block_sizes


SCORE_DOTS = ("split", "rounded")  # how fp32 score tiles enter bf16/fp16 tensor-core products


def _split(mode: str) -> bool:
    if mode not in SCORE_DOTS:
        raise ValueError(f"KernelConfig: expected kata_score_dot in {SCORE_DOTS}, got {mode!r}")
    return mode == "split"


def _launch(q, v, seq_lens, groups: int, combine: str, warps: int) -> dict:
    """The arguments every kernel launch shares: tile table, sequence starts, sizes, tiles, flags."""
    config = get_config()
    BM, BN = config.kata_block_m, config.kata_block_n
    if BM % BN or BN < 16 or BM & (BM - 1) or BN & (BN - 1):
        raise ValueError(f"KernelConfig: expected powers of two kata_block_m >= kata_block_n >= 16, got {BM}, {BN}")
    shrink = max(groups // 2, 1) * (2 if q.dtype == torch.float32 else 1)  # [G·BM, G·BN] scores <= 2x2 M1's; fp32: shared memory
    BM, BN = max(BM // shrink, 16), max(BN // shrink, 16)
    _, _, H, K = q.shape
    E, BE, BV = block_sizes(K, v.shape[-1], groups)
    tiles, _, NT = chunk_table(tuple(seq_lens), BM, q.device)
    return dict(
        grid=(NT, H), tiles=tiles, starts=sequence_starts(tuple(seq_lens), q.device), sizes=(H, K, v.shape[-1], E),
        meta=dict(G=groups, SUM=combine == "sum", BM=BM, BN=BN, BE=BE, BV=BV, F32=dot_f32(q.dtype),
                  num_warps=warps, num_stages=config.kata_num_stages),
        split=_split(config.kata_score_dot),
    )


def _flat(x):
    return None if x is None else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()  # [B, T, H, ...] -> [B*T, H, ...]


def quadratic_forward(q, k, v, g, prior, scale: float, eps: float, seq_lens, groups: int, combine: str, normalize: bool,
                      keep_lo: bool):
    """Launch forward.py's kernel on q, k, v in the kernels' dtype: `(o [B*T, H, V], den [B*T, H] fp32, o_lo)`,
    o_lo the bf16 rounding error of o (`keep_lo`) or an empty [0] tensor; prior `[B, T, H, V + 1]` fp32 or None; `seq_lens` the
    pieces the keys never cross (the sequences, or the chunked form's state chunks)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    plan = _launch(q, v, seq_lens, groups, combine, get_config().kata_num_warps)
    o = torch.empty(B * T, H, V, dtype=v.dtype, device=q.device)
    o_lo = torch.empty(B * T, H, V, dtype=torch.bfloat16, device=q.device) if keep_lo else no_output(q)
    den = torch.empty(B * T, H, dtype=torch.float32, device=q.device)
    kata_forward_kernel[plan["grid"]](
        _flat(q), _flat(k), _flat(v), _flat(g), _flat(prior), o, o_lo, den, plan["tiles"], plan["starts"],
        scale * scale, eps, *plan["sizes"],
        USE_G=g is not None, USE_PRIOR=prior is not None, NORMALIZE=normalize, SPLIT=plan["split"], STORE_LO=keep_lo,
        **plan["meta"],
    )
    return o, den, o_lo


@torch.library.custom_op("polyattn::kata_parallel_forward", mutates_args=())
def kata_parallel_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, prior: torch.Tensor | None,
    scale: float, eps: float, seq_lens: list[int], groups: int, combine: str, normalize: bool, keep_lo: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel as a custom op: `(o [B, T, H, V] in dtype, den [B, T, H] fp32, o_lo)`, o_lo the
    bf16 rounding error of o's downcast with `keep_lo` (else an empty [0] tensor); prior: `[B, T, H, V + 1]` fp32 or None.
    dtype: the kernels' input dtype; q, k, v may come in fp32 (copies of dtype values, see
    `kata_parallel_fused`), and are cast to it first."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    B, T, H, _ = q.shape
    V = v.shape[-1]
    o, den, o_lo = quadratic_forward(q, k, v, g, prior, scale, eps, seq_lens, groups, combine, normalize, keep_lo)
    return o.view(B, T, H, V), den.view(B, T, H), (o_lo.view(B, T, H, V) if keep_lo else o_lo)  # [B*T, H, ...] -> [B, T, H, ...]


@kata_parallel_forward.register_fake
def _(q, k, v, g, prior, scale, eps, seq_lens, groups, combine, normalize, keep_lo, dtype):
    B, T, H, _ = q.shape
    o_lo = v.new_empty(B, T, H, v.shape[-1], dtype=torch.bfloat16) if keep_lo else no_output(q)
    return v.new_empty(B, T, H, v.shape[-1], dtype=dtype), q.new_empty(B, T, H, dtype=torch.float32), o_lo


def rowdot(x, y, z=None):
    """`Σ_d x[..., d] (y[..., d] + z[..., d])` in fp32 (`row_dot_kernel`, one pass, no temporaries) for tensors
    of one shape `[..., D]` (dtypes may differ; z optional): `[...]`."""
    D = x.shape[-1]
    x, y, z = (None if t is None else t.reshape(-1, D).contiguous() for t in (x, y, z))
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    BD = min(block(D), 128)
    BR = 4096 // BD
    row_dot_kernel[(triton.cdiv(x.shape[0], BR),)](x, y, y if z is None else z, out, x.shape[0], D, HAS_Z=z is not None, BR=BR, BD=BD)
    return out


def prior_cotangents(do, o, o_lo, den, eps: float, normalize: bool):
    """`(r, c)` `[B, T, H]` fp32 of the normalised read's backward: the prior's gradient is `[r·do | −c]` with
    `r = 1 / max(den, eps)` and `c = r (do·o)` (0 where clamped), o taken as `o + o_lo` where the forward kept
    its rounding error (an empty o_lo: o alone); ones and zeros without normalize."""
    if not normalize:
        return torch.ones_like(den), torch.zeros_like(den)
    B, T, H = den.shape
    r = 1.0 / den.clamp_min(eps)
    dot = rowdot(do, o, o_lo if o_lo.numel() else None)  # [B*T*H]
    return r, torch.where(den > eps, r * dot.view(B, T, H), 0.0)


def quadratic_backward(do, q, k, v, g, r, c, scale: float, seq_lens, groups: int, combine: str, dq=None, dkdv=None):
    """Launch backward.py's kernels on q, k, v in the kernels' dtype, given `prior_cotangents`' r and c:
    `kata_dq_kernel` writing `dq` and `kata_dkdv_kernel` writing `dkdv = (dk, dv)` (`[B*T, H, D]` in their
    own dtypes), each where given. Returns `(qdq, kdk)`, the kernels' `q·dq`, `k·dk` per token (`[B*T, H]`
    fp32, the log-decay identity's terms; None for a kernel not launched)."""
    plan = _launch(q, v, seq_lens, groups, combine, get_config().kata_bwd_warps)
    qf, kf, vf, gf, dof, rf, cf = (_flat(x) for x in (q, k, v, g, do.to(v.dtype), r, c))
    qdq = kdk = None
    if dq is not None:
        qdq = torch.empty_like(rf)
        kata_dq_kernel[plan["grid"]](
            qf, kf, vf, gf, dof, rf, cf, dq, qdq, plan["tiles"], plan["starts"], scale * scale, *plan["sizes"],
            USE_G=g is not None, SPLIT=plan["split"], **plan["meta"],
        )
    if dkdv is not None:
        kdk = torch.empty_like(rf)
        kata_dkdv_kernel[plan["grid"]](
            qf, kf, vf, gf, dof, rf, cf, *dkdv, kdk, plan["tiles"], plan["starts"], scale * scale, *plan["sizes"],
            USE_G=g is not None, SPLIT=plan["split"], **plan["meta"],
        )
    return qdq, kdk


@torch.library.custom_op("polyattn::kata_parallel_backward", mutates_args=())
def kata_parallel_backward(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
    o: torch.Tensor, o_lo: torch.Tensor, den: torch.Tensor, scale: float, eps: float, seq_lens: list[int], groups: int,
    combine: str, normalize: bool, want_dg: bool, want_dprior: bool, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two gradient kernels and dg as a custom op: `(dq, dk, dv, dg, dprior)`, dg and dprior
    empty [0] tensors when not wanted (o_lo: the forward's rounding error of o, or an empty [0] tensor); dq, dk, dv in q's, k's, v's dtype (fp32 for fp32 copies: the kernels
    then write them unrounded), the kernels run on the inputs cast to dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dq, dk, dv = (torch.empty(x.shape[0] * x.shape[1], *x.shape[2:], dtype=x.dtype, device=x.device) for x in (q, k, v))  # [B*T, H, D]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    r, c = prior_cotangents(do, o, o_lo, den, eps, normalize)
    qdq, kdk = quadratic_backward(do, q, k, v, g, r, c, scale, seq_lens, groups, combine, dq=dq, dkdv=(dk, dv))
    dprior = torch.cat([do * r[..., None], -c[..., None]], -1) if want_dprior else no_output(q)  # [B, T, H, V + 1] fp32
    dg = no_output(q)
    if want_dg:
        dg = reverse_cumsum(0.5 * (qdq - kdk), tuple(seq_lens)).view(B, T, H).to(g.dtype)  # [B*T, H] -> [B, T, H]
    return dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, H, V), dg, dprior


@kata_parallel_backward.register_fake
def _(do, q, k, v, g, o, o_lo, den, scale, eps, seq_lens, groups, combine, normalize, want_dg, want_dprior, dtype):
    B, T, H, _ = q.shape
    dg = g.new_empty(g.shape) if want_dg else no_output(q)
    dprior = q.new_empty(B, T, H, v.shape[-1] + 1, dtype=torch.float32) if want_dprior else no_output(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dg, dprior


def _setup_context(ctx, inputs, output):
    q, k, v, g, prior, scale, eps, seq_lens, groups, combine, normalize, _, dtype = inputs
    o, den, o_lo = output
    ctx.save_for_backward(q, k, v, g, o, o_lo, den)  # the backward's do·o: o + o_lo
    ctx.options = (scale, eps, seq_lens, groups, combine, normalize)
    ctx.has_prior, ctx.dtype = prior is not None, dtype
    ctx.set_materialize_grads(False)  # no zero cotangents filled for the saved intermediates


def _backward(ctx, do, _, __):
    q, k, v, g, o, o_lo, den = ctx.saved_tensors
    do = torch.zeros_like(o) if do is None else do  # o unused (its normaliser alone carried the loss)
    want_dg = g is not None and ctx.needs_input_grad[3]
    want_dprior = ctx.has_prior and ctx.needs_input_grad[4]
    dq, dk, dv, dg, dprior = kata_parallel_backward(do, q, k, v, g, o, o_lo, den, *ctx.options, want_dg, want_dprior, ctx.dtype)
    return dq, dk, dv, dg if want_dg else None, dprior if want_dprior else None, None, None, None, None, None, None, None, None


kata_parallel_forward.register_autograd(_backward, setup_context=_setup_context)


def _sequences(tensors, state, seq_lens, packed: bool):
    """`(pieces, state rows)` per sequence of packed inputs (B = 1), or once for the whole batch;
    pieces are `[b, T_n, H, ...]` (None stays None), state rows `[b, H, P, W]` or None."""
    if not packed:
        yield tensors, state
        return
    bos = 0
    for n, length in enumerate(seq_lens):
        yield [None if x is None else x[:, bos:bos + length] for x in tensors], None if state is None else state[n:n + 1]
        bos += length


def _log_decay(g, q):
    """`[b, H, T]` fp32 log-decay of one piece (zeros without g)."""
    if g is None:
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    return g.float().transpose(1, 2)  # [b, T, H] -> [b, H, T]


def state_read(fmap, q, g, state, seq_lens, packed: bool, scale: float) -> torch.Tensor:
    """The prior `exp(G_t) ψ(scale·q_t)ᵀ [S_0 | z_0]`: `[B, T, H, V + 1]` fp32 (the bilinear read, ψ never built)."""
    reads = []
    for (qs, gs), rows in _sequences((q, g), state, seq_lens, packed):
        w = torch.exp(torch.cumsum(_log_decay(gs, qs), dim=-1))  # [b, H, T]: exp(G_t)
        read = fmap.read(scale * qs.float().transpose(1, 2), rows)  # [b, H, T, K], [b, H, P, W] -> [b, H, T, W]
        reads.append((w[..., None] * read).transpose(1, 2))  # [b, H, T, W] -> [b, T, H, W]
    return torch.cat(reads, dim=1).contiguous()


def state_write(fmap, k, v, g, state, seq_lens, packed: bool) -> torch.Tensor:
    """The final `[S | z]`: `exp(G_T) [S_0 | z_0] + Σ_s exp(G_T − G_s) ψ(k_s) [v_s | 1]ᵀ`, `[N, H, P, V + 1]` fp32."""
    finals = []
    for (ks, vs, gs), rows in _sequences((k, v, g), state, seq_lens, packed):
        gl = _log_decay(gs, ks)  # [b, H, T]
        weight = torch.exp(suffix_sum(gl))  # [b, H, T]: exp(G_T − G_s), each a direct sum
        values = weight[..., None] * with_ones(vs.float()).transpose(1, 2)  # [b, H, T, V + 1]
        final = fmap.write(ks.float().transpose(1, 2), values)  # [b, H, T, K], [b, H, T, W] -> [b, H, P, W]
        if rows is not None:
            final = final + torch.exp(gl.sum(-1))[..., None, None] * rows
        finals.append(final)
    return torch.cat(finals, dim=0)


def kata_parallel_fused(
    q, k, v, g=None, *, groups, combine, normalize, eps, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Triton quadratic form of `kata` for the PSD maps (inputs already validated, scale resolved).

    q, k: `[B, T, H, K]`; v: `[B, T, H, V]`; g: `[B, T, H]` or None; initial_state: `KataState(S [N, H, P, V],
    z [N, H, P])`; cu_seqlens: int `[N + 1]` with B == 1, handled natively (the kernels' tiles never
    cross a sequence; the host's state read and write go sequence by sequence). Returns
    `(o [B, T, H, V] in q's dtype, KataState fp32 or None)`.
    """
    check_kernel_inputs(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    seq_lens = sequence_lengths(cu_seqlens, B, T)
    fmap = make_feature_map("psd", K, groups, combine)
    packed = cu_seqlens is not None
    state = join_state(initial_state, torch.float32)  # [N, H, P, V + 1] or None
    if q.numel() == 0:
        o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
        if state is None:
            state = torch.zeros(len(seq_lens), H, fmap.dim(), V + 1, dtype=torch.float32, device=q.device)
        return o, (split_state(state.clone()) if output_final_state else None)
    dtype = q.dtype
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, state))
    if grads and dtype != torch.float32 and (state is not None or output_final_state):
        # q, k, v and g also feed the state's read and write: one fp32 copy of each feeds all three, so
        # that their gradients add in fp32 and are rounded once (ops/kata/README.md, "Backward"); a bf16
        # dg rounded twice (kernel, then state write) was 2x the PyTorch form's error at T = 1000
        q, k, v = q.float(), k.float(), v.float()
        g = None if g is None else g.float()
    prior = None if state is None else state_read(fmap, q, g, state, seq_lens, packed, scale)
    # normalized low-precision calls that will differentiate keep o's rounding error too: do·o from the
    # rounded o put dq at 1.4x the tests' bound (ops/kata/README.md, "Backward")
    keep_lo = normalize and dtype != torch.float32 and grads
    o, _, _ = kata_parallel_forward(
        q, k, v, g, prior, float(scale), float(eps), list(seq_lens), groups, combine, normalize, keep_lo, dtype,
    )
    if not output_final_state:
        return o, None
    final = state_write(fmap, k, v, g, state, seq_lens, packed)
    return o, split_state(final)


def feature_blocks(K: int, V: int, groups: int, combine: str, state_block: int) -> dict:
    """The chunked form's feature tiling: the group width `E` (a power of two, at least 4: its rows of the
    state are whole tiles), `BF = E` (the walks' feature tile), `BR` (the reads' feature tile: E, at least 16
    for the tensor cores, the columns past E masked), the block of `BE` rows of e per program (`BE·E` lifted
    features: about `state_block`, at most 8,192 fp32 state values with the whole padded V, at least 16 for
    the tensor cores), `NE` blocks per slot, the slots and `P`. ValueError for another E."""
    E = K // groups
    if E < 4 or E & (E - 1):
        raise ValueError(f"impl='triton_chunk': expected K / groups a power of two >= 4, got K = {K}, groups = {groups}")
    target = max(16, min(state_block, 8192 // block(V)))
    BE = max(16 // E, min(E, target // E))
    slots = 1 if combine == "sum" else groups
    return dict(E=E, BF=E, BR=block(E), BE=BE, BV=block(V), NE=E // BE, slots=slots, P=slots * E * E)


def _chunk_plan(q, v, seq_lens, groups: int, combine: str) -> dict:
    """What the chunked form's launches share: the state chunks (`pieces`, `cu_chunks`, NC), the feature
    tilings of the forward and the reverse walk, the sequence table, the walks' sub-tile BS, the reads'
    tile BT and the kernels' meta-parameters."""
    config = get_config()
    K = q.shape[-1]
    tiling = feature_blocks(K, v.shape[-1], groups, combine, config.kata_state_block)
    CS, BS, BT = kata_state_chunk(config, tiling["P"]), config.kata_block_n, config.kata_read_block
    if CS % BS or CS % config.kata_block_m or CS % BT:
        raise ValueError(f"KernelConfig: expected kata_chunk_size and kata_wide_chunk_size multiples of kata_block_m, "
                         f"kata_block_n and kata_read_block, got {CS}")
    pieces = chunk_lengths(tuple(seq_lens), CS)
    _, cu_chunks, NC = chunk_table(tuple(seq_lens), CS, q.device)
    return dict(
        CS=CS, BS=BS, BT=BT, tiling=tiling, pieces=pieces, cu_chunks=cu_chunks, NC=NC,
        seqs=segment_table(tuple(seq_lens), 1, CS, q.device)[0], sizes=(q.shape[2], K, v.shape[-1], tiling["E"], tiling["P"]),
        meta=dict(G=groups, SUM=combine == "sum", BV=tiling["BV"], F32=dot_f32(q.dtype),
                  num_warps=config.kata_chunk_warps),
        stages=config.kata_num_stages, read_stages=config.kata_read_stages,
    )


class Cotangents(NamedTuple):
    """The reads' cotangents as the backward's kernels take them, rows `[a_t y_t | b_t]`: never formed as one
    `[N_tok, H, V + 1]` fp32 tensor."""

    y: torch.Tensor  # [N_tok, H, V], any dtype
    a: torch.Tensor  # [N_tok, H] fp32
    b: torch.Tensor  # [N_tok, H] fp32: the normaliser's column


def chunk_states(x, y, g, h0, z0, plan: dict, N: int, store_ht: bool, reverse: bool = False):
    """`kata_states_kernel` on flattened tokens: `(hs [NC, H, P, V], zs [NC, H, P], ht [N, H, P, V], zt [N, H, P])`
    fp32, the last two empty [0] tensors without `store_ht`. Forward: x = k, y = v, h0 / z0 the initial state;
    `reverse`: x = q, y the reads' `Cotangents`, h0 / z0 the final state's gradient."""
    H, _, V, _, P = plan["sizes"]
    hs = torch.empty(plan["NC"], H, P, V, dtype=torch.float32, device=x.device)
    zs = torch.empty(plan["NC"], H, P, dtype=torch.float32, device=x.device)
    ht = torch.empty(N, H, P, V, dtype=torch.float32, device=x.device) if store_ht else no_output(x)
    zt = torch.empty(N, H, P, dtype=torch.float32, device=x.device) if store_ht else no_output(x)
    tiling = plan["tiling"]
    rows = tuple(y) if reverse else (y, None, None)
    kata_states_kernel[(tiling["slots"] * tiling["NE"], N, H)](
        x, *rows, g, h0, z0, hs, zs, ht, zt, plan["seqs"], plan["cu_chunks"], *plan["sizes"], tiling["NE"],
        BE=tiling["BE"], BF=tiling["BF"], BS=plan["BS"], SUB=plan["CS"] // plan["BS"], USE_G=g is not None, USE_H0=h0 is not None,
        STORE_HT=store_ht, REVERSE=reverse, num_stages=plan["stages"], **plan["meta"],
    )
    return hs, zs, ht, zt


def _chunk_tiles(plan: dict, device):
    """The read-side tiles of BT tokens inside the state chunks, and each chunk's first token."""
    tiles, _, NT = chunk_table(plan["pieces"], plan["BT"], device)
    return tiles, NT, sequence_starts(plan["pieces"], device)


def chunk_read(x, g, hs, zs, scale2: float, plan: dict):
    """`kata_read_kernel`: `exp(G_t - G_(cs-1))·scale2·ψ(x_t)ᵀ [S | z]_c` for every token, `[N_tok, H, V + 1]` fp32
    (g None: no decay weight)."""
    H, _, V, _, _ = plan["sizes"]
    tiles, NT, starts = _chunk_tiles(plan, x.device)
    out = torch.empty(x.shape[0], H, V + 1, dtype=torch.float32, device=x.device)
    kata_read_kernel[(NT, H)](x, g, hs, zs, out, tiles, starts, scale2, *plan["sizes"], BF=plan["tiling"]["BR"], BT=plan["BT"],
                                 USE_G=g is not None, num_stages=plan["read_stages"], **plan["meta"])
    return out


def chunk_lift_grad(x, y: Cotangents, hs, zs, plan: dict, into: torch.Tensor | None = None, read_into: torch.Tensor | None = None):
    """`kata_lift_grad_kernel`: `∇_x ψ(x_t)ᵀ [S | z]_c y_t` for every token, `[N_tok, H, K]` fp32 (y: the rows
    `[a_t y_t | b_t]`), added to `into` (fp32, x's shape) and returned where given; with `read_into`
    (`[N_tok, H, V]` fp32) the same pass adds the read `a_t ψ(x_t)ᵀ S_c` to it."""
    tiles, NT, _ = _chunk_tiles(plan, x.device)
    meta = plan["meta"]
    dx = torch.empty(x.shape, dtype=torch.float32, device=x.device) if into is None else into
    kata_lift_grad_kernel[(NT, x.shape[1])](
        x, *y, hs, zs, dx, read_into, tiles, *plan["sizes"], G=meta["G"], SUM=meta["SUM"], BF=plan["tiling"]["BR"], BT=plan["BT"],
        BV=meta["BV"], F32=meta["F32"], ACCUMULATE=into is not None, READ=read_into is not None, num_warps=meta["num_warps"],
        num_stages=plan["read_stages"],
    )
    return dx


@torch.library.custom_op("polyattn::kata_chunk_forward", mutates_args=())
def kata_chunk_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, h0: torch.Tensor | None,
    z0: torch.Tensor | None, scale: float, eps: float, seq_lens: list[int], groups: int, combine: str,
    normalize: bool, store_ht: bool, keep_lo: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked form's three kernels as a custom op (chunk.py): `(o [B, T, H, V], ht [N, H, P, V], zt [N, H, P],
    den [B, T, H], o_lo)`, the final state fp32 with `store_ht` (else empty [0] tensors), den the quadratic part's
    normaliser (fp32) and o_lo o's bf16 rounding error with `keep_lo` (else an empty [0] tensor); h0, z0: the initial `S`,
    `z` (fp32) or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    plan = _chunk_plan(q, v, seq_lens, groups, combine)
    qf, kf, vf, gf = (_flat(x) for x in (q, k, v, g))
    hs, zs, ht, zt = chunk_states(kf, vf, gf, h0, z0, plan, len(seq_lens), store_ht)
    prior = chunk_read(qf, gf, hs, zs, scale * scale, plan)
    del hs, zs
    o, den, o_lo = quadratic_forward(q, k, v, g, prior.view(B, T, H, V + 1), scale, eps, plan["pieces"], groups, combine,
                                     normalize, keep_lo)
    return o.view(B, T, H, V), ht, zt, den.view(B, T, H), (o_lo.view(B, T, H, V) if keep_lo else o_lo)  # [B*T, H, ...] -> [B, T, H, ...]


@kata_chunk_forward.register_fake
def _(q, k, v, g, h0, z0, scale, eps, seq_lens, groups, combine, normalize, store_ht, keep_lo):
    B, T, H, K = q.shape
    V = v.shape[-1]
    P = make_feature_map("psd", K, groups, combine).dim()
    ht = q.new_empty(len(seq_lens), H, P, V, dtype=torch.float32) if store_ht else no_output(q)
    zt = q.new_empty(len(seq_lens), H, P, dtype=torch.float32) if store_ht else no_output(q)
    o_lo = v.new_empty(B, T, H, V, dtype=torch.bfloat16) if keep_lo else no_output(q)
    return v.new_empty(B, T, H, V), ht, zt, q.new_empty(B, T, H, dtype=torch.float32), o_lo


@torch.library.custom_op("polyattn::kata_chunk_backward", mutates_args=())
def kata_chunk_backward(
    do: torch.Tensor, dht: torch.Tensor | None, dzt: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, g: torch.Tensor | None, h0: torch.Tensor | None, z0: torch.Tensor | None, o: torch.Tensor,
    o_lo: torch.Tensor, den: torch.Tensor, ht: torch.Tensor | None, zt: torch.Tensor | None, scale: float, eps: float, seq_lens: list[int],
    groups: int, combine: str, normalize: bool, want_dg: bool, want_dh0: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked form's backward as a custom op (ops/kata/README.md, "Chunked backward"): `(dq, dk, dv, dg,
    dh0, dz0)`, dq, dk, dv in the inputs' dtype (summed in fp32, rounded once), dg (g's dtype) and the initial
    state's gradient (fp32) empty [0] tensors when not wanted. The quadratic part's kernels give the gradients
    inside the chunks; the reads' cotangents `[r·do | −c]` go to the other kernels as `Cotangents` rows; the
    recomputed entering states and the lift-gradient kernel give the reads' dq; the reverse walk gives the
    gradient D of the state leaving every chunk, the lift-gradient kernel on it the writes' dk and the read
    kernel the writes' dv; dg comes from the log-decay identity. dq is whole (and rounded) before dk and dv
    are allocated, and the two state sequences never coexist."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = len(seq_lens)
    plan = _chunk_plan(q, v, seq_lens, groups, combine)
    qf, kf, vf, gf, dof = (_flat(x) for x in (q, k, v, g, do))
    r, c = (_flat(x) for x in prior_cotangents(do, o, o_lo, den, eps, normalize))  # [B*T, H]
    gl = torch.zeros(B * T, H, dtype=torch.float32, device=q.device) if g is None else reset_limit_ref(gf.float())  # [B*T, H]
    # dq alone beside the entering states, then dk and dv beside the state gradients; each rounded once whole
    dq = torch.empty(B * T, H, K, dtype=torch.float32, device=q.device)
    quadratic_backward(do, q, k, v, g, r, c, scale, plan["pieces"], groups, combine, dq=dq)
    hs, zs, _, _ = chunk_states(kf, vf, gf, h0, z0, plan, N, False)
    w_read = (scale * scale) * torch.exp(prefix_cumsum(gl, plan["pieces"]))  # [B*T, H]: scale² exp(G_t - G_(cs-1))
    chunk_lift_grad(qf, Cotangents(dof, w_read * r, -w_read * c), hs, zs, plan, into=dq)
    del hs, zs  # the entering states go before their gradients come: one of the two sequences at a time
    term = 0.5 * rowdot(qf, dq).view(B * T, H) if want_dg else None  # [B*T, H]: the log-decay identity's ½ q·dq
    dq = dq.view(B, T, H, K).to(q.dtype)
    dk, dv = (torch.empty(B * T, H, x.shape[-1], dtype=torch.float32, device=q.device) for x in (k, v))
    quadratic_backward(do, q, k, v, g, r, c, scale, plan["pieces"], groups, combine, dkdv=(dk, dv))
    ds, dzs, dh0, dz0 = chunk_states(qf, Cotangents(dof, (scale * scale) * r, -(scale * scale) * c), gf, dht, dzt, plan, N, want_dh0,
                                     reverse=True)
    w_write = torch.exp(reverse_cumsum(gl, plan["pieces"]) - gl)  # [B*T, H]: exp(G_(ce) - G_s)
    chunk_lift_grad(kf, Cotangents(vf, w_write, w_write), ds, dzs, plan, into=dk, read_into=dv)  # dk and dv: one pass on D
    del ds, dzs
    if want_dg:
        term -= 0.5 * rowdot(kf, dk).view(B * T, H)  # ½ (q·dq − k·dk)
    dk = dk.view(B, T, H, K).to(k.dtype)
    dg = no_output(q)
    if want_dg:
        if dht is not None:
            ends = device_lengths(seq_lens, q.device).cumsum(0) - 1  # [N]
            term[ends] += (dht * ht).sum((-1, -2)) + (dzt * zt).sum(-1)  # [N, H]: <final state, its gradient>
        dg = reverse_cumsum(term, tuple(seq_lens)).view(B, T, H).to(g.dtype)
    return (
        dq, dk, dv.view(B, T, H, V).to(v.dtype), dg,
        dh0 if want_dh0 else no_output(q), dz0 if want_dh0 else no_output(q),
    )


@kata_chunk_backward.register_fake
def _(do, dht, dzt, q, k, v, g, h0, z0, o, o_lo, den, ht, zt, scale, eps, seq_lens, groups, combine, normalize, want_dg, want_dh0):
    dg = g.new_empty(g.shape) if want_dg else no_output(q)
    dh0 = h0.new_empty(h0.shape) if want_dh0 else no_output(q)
    dz0 = z0.new_empty(z0.shape) if want_dh0 else no_output(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dg, dh0, dz0


def _chunk_setup_context(ctx, inputs, output):
    q, k, v, g, h0, z0, scale, eps, seq_lens, groups, combine, normalize, store_ht, _ = inputs
    o, ht, zt, den, o_lo = output
    ctx.save_for_backward(q, k, v, g, h0, z0, o, o_lo, den, ht if store_ht else None, zt if store_ht else None)  # do·o: o + o_lo
    ctx.options = (scale, eps, seq_lens, groups, combine, normalize)
    ctx.set_materialize_grads(False)  # no zero cotangents filled for the saved intermediates


def _chunk_backward(ctx, do, dht, dzt, _, __):
    q, k, v, g, h0, z0, o, o_lo, den, ht, zt = ctx.saved_tensors
    do = torch.zeros_like(o) if do is None else do  # o unused: only the final state carries a gradient
    want_dg = g is not None and ctx.needs_input_grad[3]
    want_dh0 = h0 is not None and (ctx.needs_input_grad[4] or ctx.needs_input_grad[5])
    if ht is not None and any(x is not None and x.numel() for x in (dht, dzt)):  # the final state is used
        dht = torch.zeros_like(ht) if dht is None or not dht.numel() else dht.float().contiguous()
        dzt = torch.zeros_like(zt) if dzt is None or not dzt.numel() else dzt.float().contiguous()
    else:
        dht, dzt = None, None
    dq, dk, dv, dg, dh0, dz0 = kata_chunk_backward(
        do.contiguous(), dht, dzt, q, k, v, g, h0, z0, o, o_lo, den, ht, zt, *ctx.options, want_dg, want_dh0,
    )
    return (dq, dk, dv, dg if want_dg else None, dh0 if want_dh0 else None, dz0 if want_dh0 else None,
            None, None, None, None, None, None, None, None)


kata_chunk_forward.register_autograd(_chunk_backward, setup_context=_chunk_setup_context)


def kata_chunk_fused(
    q, k, v, g=None, *, groups, combine, normalize, eps, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Triton chunked lifted-state form of `kata` for the PSD maps (inputs already validated, scale resolved):
    linear in T, where the quadratic form grows as T², forward and backward (`kata_chunk_backward`). q, k:
    `[B, T, H, K]`; v: `[B, T, H, V]`; g: `[B, T, H]` or None; initial_state: `KataState`; cu_seqlens: int
    `[N + 1]` with B == 1, handled natively. Returns `(o [B, T, H, V] in q's dtype, KataState fp32 or None)`."""
    check_kernel_inputs(q)
    seq_lens = sequence_lengths(cu_seqlens, *q.shape[:2])
    if q.numel() == 0:
        return kata_parallel_fused(q, k, v, g, groups=groups, combine=combine, normalize=normalize, eps=eps, scale=scale,
                                   initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    h0, z0 = (None, None) if initial_state is None else (x.float().contiguous() for x in initial_state)
    # normalized low-precision calls that will differentiate keep o's rounding error for the backward's do·o, as the quadratic form
    keep_lo = normalize and q.dtype != torch.float32 and wants_grad((q, k, v, g, initial_state))
    o, ht, zt, _, _ = kata_chunk_forward(q, k, v, g, h0, z0, float(scale), float(eps), list(seq_lens), groups, combine,
                                         normalize, output_final_state, keep_lo)
    return o, (KataState(ht, zt) if output_final_state else None)
