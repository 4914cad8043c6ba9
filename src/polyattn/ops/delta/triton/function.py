"""Autograd Function and form function of the Triton `delta_rule`.

Forward: wy.py (the per-chunk solve, parallel), then forward.py (the recurrence with the state on
chip, which forms the outputs too, or leaves them to a per-chunk kernel: `KernelConfig.delta_fused_outputs`).
Backward: backward.py's per-chunk factors of dR, its reverse recurrence for the state gradient,
then its per-chunk kernel for dq, dk, dv, dbeta. The log-decay gradient needs no kernel of its own: writing
`S~_t = exp(-G_t) S_t` turns the gated rule into the ungated one on `q~_t = exp(G_t) q_t` and
`v~_t = exp(-G_t) v_t` (ops/delta/README.md, "Gradients"), so

    dL/dG_t = q_t . dq_t - v_t . dv_t  (+ <dht, ht> at a sequence's last token)

and dg is its per-sequence reverse cumsum (`G` is the inclusive cumsum of g).
With few walks (`KernelConfig.delta_split_per_sm`, `delta_split_fill`), the forward recurrence (and with
`delta_split_backward` the reverse one) runs in segments of a sequence at once, each from the
state (or gradient) that the segments' affine maps carry to it (`split_plan`, `entering_states`,
`leaving_gradients`; ops/delta/README.md, "Segments").
"""
import functools

import torch
import triton

from polyattn.ops.triton.plan import (
    block, chunk_table, device_lengths, get_config, kernel_call, narrow_block, no_output, num_sms, plan_segments,
    reverse_cumsum, segment_starts, segment_table,
)
from polyattn.ops.triton.precision import dot_f32, fp32_dot_mode

from .backward import delta_grad_factors_kernel, delta_grads_kernel, delta_score_grads, delta_state_grad_kernel
from .forward import delta_outputs_kernel, delta_states_kernel
from .step import delta_rule_step_inplace
from .wy import wy_solve


def _num_chunks(seq_lens, C: int) -> int:
    """Rows of the chunk table: every sequence has at least one (plan.chunk_table)."""
    return sum(max(1, triton.cdiv(n, C)) for n in seq_lens)


def fused_outputs(config, walks: int, device) -> bool:
    """Whether the recurrence forms the outputs (`KernelConfig.delta_fused_outputs`; None: when its `walks`
    programs outnumber the multiprocessors, so that the outputs' work is spread about as widely as the
    per-chunk kernel would spread it)."""
    if config.delta_fused_outputs is not None:
        return config.delta_fused_outputs
    return walks > num_sms(device)


@functools.lru_cache(maxsize=64)
def split_plan(seq_lens: tuple, segments: int, C: int, device: str) -> dict:
    """The recurrence's segment split (ops/delta/README.md, "Segments"), built on the host and cached per shape:
    `walks [S, 4]` the segments' rows `(bos, eos, sequence, 0)` and `walk_chunks [S]` their first chunks (the index
    of the per-chunk buffers); `pre [P, 4]`, `pre_chunks [P]` the same for the segments that another one follows,
    `post`, `post_chunks` for those that follow another (the reverse recurrence's); `heads [N]`, `ends [N]` each
    sequence's first and last segment; `steps`, per rank j ≥ 1 of a segment in its sequence, the indices `(pre row
    of segment j - 1, segment j - 1, segment j)`; `back_steps`, per rank from the end, `(post row of segment j,
    segment j, segment j - 1)`: the gradient leaving segment j - 1 is the one entering segment j."""
    walks, walk_chunks, pre, pre_chunks, post, post_chunks, heads, ends = [], [], [], [], [], [], [], []
    steps: dict[int, list] = {}
    back_steps: dict[int, list] = {}
    bos = chunk0 = 0
    for n, length in enumerate(seq_lens):
        starts, seg_len = segment_starts(length, segments, C)  # the linear passes' cut (plan.segment_table)
        heads.append(len(walks))
        for j, s in enumerate(starts):
            c = s // C
            row = (bos + s, bos + min(s + seg_len, length), n, 0)
            if j > 0:
                steps.setdefault(j, []).append((len(pre) - 1, len(walks) - 1, len(walks)))
            if j < len(starts) - 1:
                pre.append(row)
                pre_chunks.append(chunk0 + c)
            if j > 0:  # in reverse, segment j - 1 follows segment j
                back_steps.setdefault(len(starts) - j, []).append((len(post), len(walks), len(walks) - 1))
                post.append(row)
                post_chunks.append(chunk0 + c)
            walks.append(row)
            walk_chunks.append(chunk0 + c)
        ends.append(len(walks) - 1)
        bos += length
        chunk0 += max(1, triton.cdiv(length, C))

    def ints(x, dtype=torch.int32):
        return torch.tensor(x, dtype=dtype).to(device)

    return dict(walks=ints(walks), walk_chunks=ints(walk_chunks), pre=ints(pre), pre_chunks=ints(pre_chunks),
                post=ints(post), post_chunks=ints(post_chunks), heads=ints(heads, torch.long), ends=ints(ends, torch.long),
                steps=[ints(steps[j], torch.long).unbind(1) for j in sorted(steps)],
                back_steps=[ints(back_steps[j], torch.long).unbind(1) for j in sorted(back_steps)])


def split(config, seq_lens: tuple, H: int, V: int, BV: int, C: int, device, *, backward: bool = False) -> dict | None:
    """The segment split of the forward (or with `backward`, the reverse) recurrence (`split_plan`), or None:
    when `KernelConfig.delta_split_per_sm` is 0, when the unsplit walks fill more than `delta_split_fill` of the
    multiprocessors, or for the reverse recurrence without `delta_split_backward`. Each split recurrence does
    `1 + 2 (S - 1) / S` walks' work (ops/delta/README.md, "Segments"), which pays only on a mostly idle GPU."""
    if not config.delta_split_per_sm or backward and not config.delta_split_backward:
        return None
    segments = plan_segments(seq_lens, H, V, config, device, block=BV, per_sm=config.delta_split_per_sm,
                             fill=config.delta_split_fill)
    return split_plan(seq_lens, segments, C, str(device)) if segments > 1 else None


def value_tile(config, n_seqs: int, H: int, V: int, device) -> int:
    """The value tile of an unsplit recurrence: `delta_block_v`, halved down to 16 while its `n_seqs * H *
    cdiv(V, BV)` walks number at most `delta_narrow_per_sm` per multiprocessor. A walk is a chain of dependent
    products per chunk, so with one walk or none on most multiprocessors twice the narrower walks finish sooner
    (ops/delta/README.md, "Segments")."""
    return narrow_block(min(block(V), config.delta_block_v), V, n_seqs * H, config.delta_narrow_per_sm * num_sms(device))


def y_factor(qf: torch.Tensor) -> torch.Tensor:
    """The buffer of the reverse recurrence's factor Y (backward.py): `[1, N_tok, H, K]` fp32 for fp32 inputs,
    else `[2, N_tok, H, K]` in their dtype, Y's two halves (the same bytes as fp32, split once)."""
    halves = 1 if qf.dtype == torch.float32 else 2
    return torch.empty(halves, *qf.shape, dtype=qf.dtype, device=qf.device)


def identity_start(P: int, H: int, K: int, W: int, device) -> torch.Tensor:
    """`[I | 0]` for P segments: `[P, H, K, W]` fp32."""
    start = torch.zeros(P, H, K, W, dtype=torch.float32, device=device)
    start[..., :K] = torch.eye(K, dtype=torch.float32, device=device)
    return start


def chain(maps: torch.Tensor, known, known_rows, steps: list, S: int) -> torch.Tensor:
    """Every segment's state from the segments' affine maps `maps [P, H, K, K + V]` (`[M | b]`: `h -> M h + b`), in
    float64: `known [N, H, K, V]` (or zero) at the rows `known_rows`, then per rank `state[dst] = M[row] state[src] +
    b[row]` for the `(row, src, dst)` of `steps`. Returns `[S, H, K, V]` fp32."""
    maps = maps.double()
    K = maps.shape[-2]
    states = torch.zeros(S, *maps.shape[1:3], maps.shape[-1] - K, dtype=torch.float64, device=maps.device)
    if known is not None:
        states[known_rows] = known.double()
    for row, src, dst in steps:
        states[dst] = maps[row, ..., :K] @ states[src] + maps[row, ..., K:]  # [n, H, K, K] @ [n, H, K, V] -> [n, H, K, V]
    return states.float()


def leaving_gradients(qf, kf, dof, bf, gf, xs, ys, dht, plan: dict, *, scale: float, C: int, BV: int, config) -> torch.Tensor:
    """The state gradient leaving every segment of `plan`: `[S, H, K, V]` fp32. The reverse recurrence is affine in
    the gradient it starts from too, `dh' -> N dh' + c`: every segment that another one follows in reverse runs it
    from `[I | 0]` on `[0 | dO]`, `[0 | X]` (zeros on the identity's columns, read as such: `LEAD`; its state is then
    `[N | c]`), and each sequence chains the maps from its
    end, in float64, from `dht` (or zero)."""
    _, H, K = kf.shape
    W = K + dof.shape[-1]
    post = plan["post"]
    start = identity_start(post.shape[0], H, K, W, kf.device)
    Nc = torch.empty_like(start)  # [P, H, K, K + V]
    none = no_output(kf)
    delta_state_grad_kernel[(triton.cdiv(W, BV), post.shape[0], H)](
        qf, kf, dof, bf, gf, xs, ys[0], ys[-1], post, plan["post_chunks"], start, Nc, none, none, scale, H, K, W,
        C=C, BK=block(K), BV=BV, USE_G=gf is not None, USE_DHT=True, STORE_DH0=True, SAVE=False,
        F32=dot_f32(qf.dtype), FP32_DOT=fp32_dot_mode(config, "delta_fp32_dot"), LEAD=K,
        num_warps=config.delta_num_warps, num_stages=config.num_stages,
    )
    return chain(Nc, dht, plan["ends"], plan["back_steps"], plan["walks"].shape[0])


def entering_states(kf, vf, bf, gf, t_inv, firsts, h0, plan: dict, *, C: int, BV: int, config) -> torch.Tensor:
    """The state entering every segment of `plan` (`split_plan`): `[S, H, K, V]` fp32. The segments that another
    one follows run the recurrence at once, each from `[I | 0]` on values `[0 | v]` (the identity's columns read
    zeros: `LEAD`), so that the state leaving one is
    `[M | b]`, its affine map `h -> M h + b`; then each sequence's segments chain these maps, in float64."""
    _, H, K = kf.shape
    W = K + vf.shape[-1]
    P = plan["pre"].shape[0]
    start = identity_start(P, H, K, W, kf.device)
    Mb = torch.empty_like(start)  # [P, H, K, K + V]
    none = no_output(kf)
    delta_states_kernel[(triton.cdiv(W, BV), P, H)](
        kf, kf, vf, bf, gf, t_inv, firsts, plan["pre"], plan["pre_chunks"], start, Mb, none, none, none, 1.0, H, K, W,
        C=C, BK=block(K), BV=BV, USE_G=gf is not None, USE_H0=True, STORE_HT=True, SAVE=False, OUT=False,
        F32=dot_f32(kf.dtype), FP32_DOT=fp32_dot_mode(config, "delta_fp32_dot"), OUT_DOT=0, LEAD=K,  # no outputs
        num_warps=config.delta_num_warps, num_stages=config.num_stages,
    )
    return chain(Mb, h0, plan["heads"], plan["steps"], plan["walks"].shape[0])


def _flatten(q, k, v, beta, g, seq_lens):
    """What both kernel ops start from: the launch config, the sizes `(B, T, H, K, V, C, N)`, the
    inputs flattened to tokens (`[B*T, H, ...]`, contiguous), the lengths and the two tables."""
    config = get_config()
    B, T, H, K = q.shape
    C, seq_lens = config.chunk_size, tuple(seq_lens)
    flat = tuple(x.reshape(B * T, H, x.shape[-1]).contiguous() for x in (q, k, v))  # [B, T, H, D] -> [B*T, H, D]
    flat += (beta.reshape(B * T, H).contiguous(), g.reshape(B * T, H).contiguous() if g is not None else None)
    sizes = (B, T, H, K, v.shape[-1], C, len(seq_lens))
    return config, sizes, flat, seq_lens, chunk_table(seq_lens, C, q.device), segment_table(seq_lens, 1, C, q.device)[0]


@torch.library.custom_op("polyattn::delta_rule_forward", mutates_args=())
def delta_rule_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
    h0: torch.Tensor | None, scale: float, seq_lens: list[int], store_ht: bool, save: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernels as a custom op (torch.compile sees one opaque call). Returns `(o [B, T, H, V],
    ht [N, H, K, V], t_inv [B*T, H, C], hs [NC, H, K, V], us [B*T, H, V])`, fp32 but o; ht without
    store_ht and hs, us without save are empty [0] tensors."""
    config, (B, T, H, K, V, C, N), (qf, kf, vf, bf, gf), seq_lens, chunks, seqs = _flatten(q, k, v, beta, g, seq_lens)
    h0 = h0.float().contiguous() if h0 is not None else None
    F32, FP32_DOT, USE_G = dot_f32(q.dtype), fp32_dot_mode(config, "delta_fp32_dot"), gf is not None
    OUT_DOT = fp32_dot_mode(config, "delta_out_dot")
    t_inv, firsts = wy_solve(kf, bf, gf, chunk_size=C, chunks=chunks, num_warps=config.num_warps)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if store_ht else no_output(q)
    BK, BV = block(K), min(block(V), config.delta_block_v)
    plan = split(config, seq_lens, H, V, BV, C, q.device)
    walks, walk_chunks, walk_h0, walk_ht = seqs, chunks[1], h0, ht
    if plan is None:
        BV = value_tile(config, N, H, V, q.device)
    else:
        walks, walk_chunks = plan["walks"], plan["walk_chunks"]
        walk_h0 = entering_states(kf, vf, bf, gf, t_inv, firsts, h0, plan, C=C, BV=BV, config=config)
        walk_ht = torch.empty_like(walk_h0) if store_ht else ht
    n_walks = walks.shape[0]
    fused = fused_outputs(config, triton.cdiv(V, BV) * n_walks * H, q.device)
    keep = save or not fused  # the separate output kernel reads hs and us
    hs = torch.empty(chunks[2], H, K, V, dtype=torch.float32, device=q.device) if keep else no_output(q)
    us = torch.empty(B * T, H, V, dtype=torch.float32, device=q.device) if keep else no_output(q)
    o = torch.empty_like(vf)
    delta_states_kernel[(triton.cdiv(V, BV), n_walks, H)](
        qf, kf, vf, bf, gf, t_inv, firsts, walks, walk_chunks, walk_h0, walk_ht, hs, us, o, scale, H, K, V,
        C=C, BK=BK, BV=BV, USE_G=USE_G, USE_H0=walk_h0 is not None, STORE_HT=store_ht, SAVE=keep, OUT=fused,
        F32=F32, FP32_DOT=FP32_DOT, OUT_DOT=OUT_DOT, LEAD=0, num_warps=config.delta_num_warps, num_stages=config.num_stages,
    )
    if plan is not None and store_ht:
        ht = walk_ht[plan["ends"]]  # [S, H, K, V] -> [N, H, K, V]: the last segment's leaving state
    if not fused:
        BVO = min(block(V), config.delta_out_block_v)
        delta_outputs_kernel[(triton.cdiv(V, BVO) * chunks[2], H)](
            qf, kf, vf, gf, us, hs, firsts, o, chunks[0], scale, H, K, V,
            C=C, BK=BK, BV=BVO, USE_G=USE_G, F32=F32, OUT_DOT=OUT_DOT,
            num_warps=config.delta_chunk_warps, num_stages=config.num_stages,
        )
    if not save:
        hs, us = no_output(q), no_output(q)
    return o.view(B, T, H, V), ht, t_inv, hs, us  # [B*T, H, V] -> [B, T, H, V]


@delta_rule_forward.register_fake
def _(q, k, v, beta, g, h0, scale, seq_lens, store_ht, save):
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = get_config().chunk_size
    ht = q.new_empty(len(seq_lens), H, K, V, dtype=torch.float32) if store_ht else no_output(q)
    hs = q.new_empty(_num_chunks(seq_lens, C), H, K, V, dtype=torch.float32) if save else no_output(q)
    us = q.new_empty(B * T, H, V, dtype=torch.float32) if save else no_output(q)
    return v.new_empty(B, T, H, V), ht, q.new_empty(B * T, H, C, dtype=torch.float32), hs, us


@torch.library.custom_op("polyattn::delta_rule_backward", mutates_args=())
def delta_rule_backward(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    beta: torch.Tensor, g: torch.Tensor | None, t_inv: torch.Tensor, hs: torch.Tensor, us: torch.Tensor,
    ht: torch.Tensor | None, scale: float, seq_lens: list[int], want_dh0: bool, want_dg: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernels and dg as a custom op: `(dq, dk, dv, dbeta, dg, dh0)`, dg and dh0 empty
    [0] tensors when not wanted."""
    config, (B, T, H, K, V, C, N), (qf, kf, vf, bf, gf), seq_lens, chunks, seqs = _flatten(q, k, v, beta, g, seq_lens)
    if config.num_stages < 2:  # ops/delta/README.md, "Triton kernels"
        raise ValueError("delta_rule's backward needs KernelConfig.num_stages >= 2: at 1 Triton 3.6 lowers its reverse "
                         "walk with out-of-bounds shared-memory reads (wrong gradients, or an illegal memory access)")
    dof = do.reshape(B * T, H, V).contiguous()  # [B, T, H, V] -> [B*T, H, V]
    dht = dht.float().contiguous() if dht is not None else None
    dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=qf.device) if want_dh0 else None
    dhs = torch.empty_like(hs)
    drs = torch.empty_like(us)
    BK, BV = block(K), min(block(V), config.delta_block_v)
    F32, FP32_DOT = dot_f32(qf.dtype), fp32_dot_mode(config, "delta_fp32_dot")
    xs, ys = torch.empty_like(us), y_factor(qf)
    delta_grad_factors_kernel[(chunks[2], H)](
        qf, kf, dof, gf, t_inv, chunks[0], xs, ys[0], ys[-1], scale, H, K, V,
        C=C, BK=BK, BD=64, USE_G=gf is not None, F32=F32, FP32_DOT=FP32_DOT, num_warps=config.num_warps,
    )
    plan = split(config, seq_lens, H, V, BV, C, qf.device, backward=True)
    walks, walk_chunks, walk_dht, walk_dh0 = seqs, chunks[1], dht, dh0
    if plan is None:
        BV = value_tile(config, N, H, V, qf.device)
    else:
        walks, walk_chunks = plan["walks"], plan["walk_chunks"]
        walk_dht = leaving_gradients(qf, kf, dof, bf, gf, xs, ys, dht, plan, scale=scale, C=C, BV=BV, config=config)
        walk_dh0 = torch.empty_like(walk_dht) if dh0 is not None else None
    delta_state_grad_kernel[(triton.cdiv(V, BV), walks.shape[0], H)](
        qf, kf, dof, bf, gf, xs, ys[0], ys[-1], walks, walk_chunks, walk_dht, walk_dh0, dhs, drs,
        scale, H, K, V,
        C=C, BK=BK, BV=BV, USE_G=gf is not None, USE_DHT=walk_dht is not None, STORE_DH0=dh0 is not None, SAVE=True,
        F32=F32, FP32_DOT=FP32_DOT, LEAD=0, num_warps=config.delta_num_warps, num_stages=config.num_stages,
    )
    if plan is not None and dh0 is not None:
        dh0 = walk_dh0[plan["heads"]]  # [S, H, K, V] -> [N, H, K, V]: the first segment's entering gradient
    del xs, ys
    BVG = min(block(V), config.delta_grad_block_v)
    dss, mms, dv, dbeta, vdv = delta_score_grads(
        kf, vf, bf, gf, dof, us, drs, scale=scale, chunks=chunks, chunk_size=C, block_v=BVG, fp32_dot=FP32_DOT,
        num_warps=config.delta_chunk_warps, num_stages=config.num_stages,
    )
    BKT = min(BK, config.delta_grad_block_k)
    n_k = triton.cdiv(K, BKT)
    dq, dk = torch.empty_like(qf), torch.empty_like(kf)
    dbh, qdq = (torch.empty(n_k, B * T, H, dtype=torch.float32, device=qf.device) for _ in range(2))
    delta_grads_kernel[(n_k * chunks[2], H)](
        qf, kf, gf, bf, dof, chunks[0], hs, dhs, us, drs, dss, mms, dq, dk, dbh, qdq,
        scale, B * T, H, K, V,
        C=C, BK=BKT, BV=BVG, USE_G=gf is not None, F32=F32, FP32_DOT=FP32_DOT,
        num_warps=config.delta_chunk_warps, num_stages=config.num_stages,
    )
    del dss, mms
    dbeta += dbh.sum(0)  # [n_k, B*T, H] -> [B*T, H]
    dg = no_output(q)
    if want_dg:
        dgterm = qdq.sum(0) - vdv  # q . dq - v . dv, [n_k, B*T, H] -> [B*T, H]
        if dht is not None:
            ends = device_lengths(seq_lens, qf.device).cumsum(0) - 1  # [N]
            dgterm[ends] += (dht * ht).sum((-1, -2))  # [N, H, K, V] -> [N, H]
        dg = reverse_cumsum(dgterm, seq_lens).view(B, T, H).to(g.dtype)  # [B*T, H] -> [B, T, H]
    return (
        dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, H, V),
        dbeta.view(B, T, H).to(beta.dtype), dg, dh0 if dh0 is not None else no_output(q),
    )


@delta_rule_backward.register_fake
def _(do, dht, q, k, v, beta, g, t_inv, hs, us, ht, scale, seq_lens, want_dh0, want_dg):
    B, T, H, K = q.shape
    dg = g.new_empty(g.shape) if want_dg else no_output(q)
    dh0 = q.new_empty(len(seq_lens), H, K, v.shape[-1], dtype=torch.float32) if want_dh0 else no_output(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), beta.new_empty(beta.shape), dg, dh0


def _setup_context(ctx, inputs, output):
    q, k, v, beta, g, h0, scale, seq_lens, store_ht, save = inputs
    _, ht, t_inv, hs, us = output
    ctx.save_for_backward(q, k, v, beta, g, t_inv, hs, us, ht if store_ht else None)
    ctx.scale, ctx.seq_lens, ctx.has_h0 = scale, seq_lens, h0 is not None
    ctx.set_materialize_grads(False)  # no zero cotangents filled for the saved intermediates (a GiB at 64K tokens)


def _backward(ctx, do, dht, *_):
    q, k, v, beta, g, t_inv, hs, us, ht = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do  # o unused: only the final state carries a gradient
    want_dh0 = ctx.has_h0 and ctx.needs_input_grad[5]
    want_dg = g is not None and ctx.needs_input_grad[4]
    dht = dht if dht is not None and dht.numel() else None
    dq, dk, dv, dbeta, dg, dh0 = delta_rule_backward(
        do, dht, q, k, v, beta, g, t_inv, hs, us, ht, ctx.scale, ctx.seq_lens, want_dh0, want_dg,
    )
    return dq, dk, dv, dbeta, dg if want_dg else None, dh0 if want_dh0 else None, None, None, None, None


delta_rule_forward.register_autograd(_backward, setup_context=_setup_context)


def _apply(q, k, v, beta, g, initial_state, scale, seq_lens, output_final_state):
    """The kernels through the custom ops; the per-chunk states and pseudo-values are kept only
    when a gradient may be wanted, the final state only when it is asked for (stored, it would come
    back to the backward as a gradient of zeros)."""
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, beta, g, initial_state))
    o, ht, _, _, _ = delta_rule_forward(q, k, v, beta, g, initial_state, scale, list(seq_lens), output_final_state, save)
    return o, (ht if output_final_state else None)


def delta_rule_fused(q, k, v, beta, g=None, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Triton form of `delta_rule` (inputs already validated, scale resolved).

    q, k: [B, T, H, K]; v: [B, T, H, V]; beta, g: [B, T, H] (g may be None); initial_state:
    [N, H, K, V]; cu_seqlens: int [N + 1] with B == 1, handled natively. One token per sequence
    without gradients (decoding) runs the fused step on a copy of the state. Returns
    `(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 or None)`.
    """
    return kernel_call(
        (q, k, v, beta), g, initial_state, output_final_state, cu_seqlens,
        scale=scale, step=delta_rule_step_inplace, function=_apply,
    )
