"""Autograd Function and form function of the Triton `delta_rule`.

Forward: wy.py (the per-chunk solve, parallel), then forward.py (the recurrence with the state on
chip, which forms the outputs too, or leaves them to a per-chunk kernel: `KernelConfig.delta_fused_outputs`).
Backward: backward.py's per-chunk factors of dR, its reverse recurrence for the state gradient,
then its per-chunk kernel for dq, dk, dv, dbeta. The log-decay gradient needs no kernel of its own: writing
`S~_t = exp(-G_t) S_t` turns the gated rule into the ungated one on `q~_t = exp(G_t) q_t` and
`v~_t = exp(-G_t) v_t` (ops/delta/README.md, "Gradients"), so

    dL/dG_t = q_t . dq_t - v_t . dv_t  (+ <dht, ht> at a sequence's last token)

and dg is its per-sequence reverse cumsum (`G` is the inclusive cumsum of g).
"""
import torch
import triton

from polyattn.ops.triton.plan import (
    block, chunk_table, get_config, kernel_call, no_output, num_sms, reverse_cumsum, segment_table,
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
    programs number at least twice the multiprocessors, so that the outputs' work is spread as widely
    as the per-chunk kernel would spread it)."""
    if config.delta_fused_outputs is not None:
        return config.delta_fused_outputs
    return walks >= 2 * num_sms(device)


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
    t_inv, firsts = wy_solve(kf, bf, gf, chunk_size=C, chunks=chunks, num_warps=config.num_warps)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if store_ht else no_output(q)
    BK, BV = block(K), min(block(V), config.delta_block_v)
    fused = fused_outputs(config, triton.cdiv(V, BV) * N * H, q.device)
    keep = save or not fused  # the separate output kernel reads hs and us
    hs = torch.empty(chunks[2], H, K, V, dtype=torch.float32, device=q.device) if keep else no_output(q)
    us = torch.empty(B * T, H, V, dtype=torch.float32, device=q.device) if keep else no_output(q)
    o = torch.empty_like(vf)
    F32, FP32_DOT, USE_G = dot_f32(q.dtype), fp32_dot_mode(config, "delta_fp32_dot"), gf is not None
    delta_states_kernel[(triton.cdiv(V, BV), N, H)](
        qf, kf, vf, bf, gf, t_inv, firsts, seqs, chunks[1], h0, ht, hs, us, o, scale, H, K, V,
        C=C, BK=BK, BV=BV, USE_G=USE_G, USE_H0=h0 is not None, STORE_HT=store_ht, SAVE=keep, OUT=fused,
        F32=F32, FP32_DOT=FP32_DOT, num_warps=config.delta_num_warps, num_stages=config.num_stages,
    )
    if not fused:
        BVO = min(block(V), config.delta_out_block_v)
        delta_outputs_kernel[(chunks[2], H, triton.cdiv(V, BVO))](
            qf, kf, vf, gf, us, hs, firsts, o, chunks[0], scale, H, K, V,
            C=C, BK=BK, BV=BVO, USE_G=USE_G, F32=F32, FP32_DOT=FP32_DOT,
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
    dof = do.reshape(B * T, H, V).contiguous()  # [B, T, H, V] -> [B*T, H, V]
    dht = dht.float().contiguous() if dht is not None else None
    dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=qf.device) if want_dh0 else None
    dhs = torch.empty_like(hs)
    drs = torch.empty_like(us)
    BK, BV = block(K), min(block(V), config.delta_block_v)
    n_v = triton.cdiv(V, BV)
    F32, FP32_DOT = dot_f32(qf.dtype), fp32_dot_mode(config, "delta_fp32_dot")
    xs, ys = torch.empty_like(us), torch.empty(B * T, H, K, dtype=torch.float32, device=qf.device)
    delta_grad_factors_kernel[(chunks[2], H)](
        qf, kf, dof, gf, t_inv, chunks[0], xs, ys, scale, H, K, V,
        C=C, BK=BK, BD=64, USE_G=gf is not None, F32=F32, FP32_DOT=FP32_DOT, num_warps=config.num_warps,
    )
    delta_state_grad_kernel[(n_v, N, H)](
        qf, kf, dof, bf, gf, xs, ys, seqs, chunks[1], dht, dh0, dhs, drs,
        scale, H, K, V,
        C=C, BK=BK, BV=BV, USE_G=gf is not None, USE_DHT=dht is not None, STORE_DH0=dh0 is not None,
        F32=F32, FP32_DOT=FP32_DOT, num_warps=config.delta_num_warps, num_stages=config.num_stages,
    )
    del xs, ys
    dss, mms, dv, dbeta, vdv = delta_score_grads(
        kf, vf, bf, gf, dof, us, drs, scale=scale, chunks=chunks, chunk_size=C, block_v=BV, fp32_dot=FP32_DOT,
        num_warps=config.delta_chunk_warps, num_stages=config.num_stages,
    )
    BKT = min(BK, 64)
    n_k = triton.cdiv(K, BKT)
    dq, dk = torch.empty_like(qf), torch.empty_like(kf)
    dbh, qdq = (torch.empty(n_k, B * T, H, dtype=torch.float32, device=qf.device) for _ in range(2))
    delta_grads_kernel[(chunks[2], H, n_k)](
        qf, kf, gf, bf, dof, chunks[0], hs, dhs, us, drs, dss, mms, dq, dk, dbh, qdq,
        scale, B * T, H, K, V,
        C=C, BK=BKT, BV=BV, USE_G=gf is not None, F32=F32, FP32_DOT=FP32_DOT,
        num_warps=config.delta_chunk_warps, num_stages=config.num_stages,
    )
    del dss, mms
    dbeta += dbh.sum(0)  # [n_k, B*T, H] -> [B*T, H]
    dg = no_output(q)
    if want_dg:
        dgterm = qdq.sum(0) - vdv  # q . dq - v . dv, [n_k, B*T, H] -> [B*T, H]
        if dht is not None:
            ends = torch.tensor(seq_lens, device=qf.device).cumsum(0) - 1  # [N]
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


def _backward(ctx, do, dht, *_):
    q, k, v, beta, g, t_inv, hs, us, ht = ctx.saved_tensors
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
    when a gradient may be wanted."""
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, beta, g, initial_state))
    store_ht = output_final_state or save
    o, ht, _, _, _ = delta_rule_forward(q, k, v, beta, g, initial_state, scale, list(seq_lens), store_ht, save)
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
