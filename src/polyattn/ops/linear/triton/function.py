"""Autograd Function and form function of the Triton `linear_attn`.

Forward: one causal pass `o = pass(q, k, v)` (launch.py). Backward, with `do` the output
gradient and `dht` the final-state gradient (the reverse state starts from it):

    dq = causal     pass(a=do, b=v,  c=k;  initial state h0^T)
    dv = anticausal pass(a=k,  b=q,  c=do; initial state dht / scale)  -> dh0 = scale * final
    dk = anticausal pass(a=v,  b=do, c=q;  initial state dht^T / scale)
    dg = reverse_cumsum_within_sequence(q . dq - k . dk) + <dht, ht>

every pass with the same `scale` on its outputs (the reverse state of dv/dk is kept divided
by scale, so the unscaled dht enters as dht / scale).

The last line: with `G_t` the inclusive cumsum of g, `dL/dG_t = q_t . dq_t - k_t . dk_t`
(plus `<dht, ht>` at the sequence's last token, since ht carries exp(G_T)), and g_t enters
every G_s with s >= t.
"""
import torch

from polyattn.ops.triton.plan import kernel_call, reverse_cumsum

from .launch import chunk_pass
from .step import linear_attn_step_inplace


class LinearAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale, seq_lens, output_final_state):
        B, T, H, K = q.shape
        V = v.shape[-1]
        qf, kf, vf = (x.reshape(B * T, H, x.shape[-1]).contiguous() for x in (q, k, v))  # [B, T, H, D] -> [B*T, H, D]
        gf = g.reshape(B * T, H).contiguous() if g is not None else None  # [B, T, H] -> [B*T, H]
        h0 = initial_state.contiguous() if initial_state is not None else None
        o, ht, _ = chunk_pass(
            qf, kf, vf, gf, seq_lens, scale=scale, reverse=False,
            initial_state=h0, store_final_state=output_final_state,
        )
        ctx.save_for_backward(qf, kf, vf, gf, h0, ht)
        ctx.scale, ctx.seq_lens, ctx.shape = scale, seq_lens, (B, T, H, K, V)
        return o.view(B, T, H, V), ht  # [B*T, H, V] -> [B, T, H, V]

    @staticmethod
    def backward(ctx, do, dht):
        qf, kf, vf, gf, h0, ht = ctx.saved_tensors
        scale, seq_lens = ctx.scale, ctx.seq_lens
        B, T, H, K, V = ctx.shape
        dof = do.reshape(B * T, H, V).contiguous()  # [B, T, H, V] -> [B*T, H, V]
        dht_scaled = dht / scale if dht is not None else None  # [N, H, K, V], the reverse state's units
        want_dg = gf is not None and ctx.needs_input_grad[3]
        want_dh0 = h0 is not None and ctx.needs_input_grad[4]
        dq, _, q_dq = chunk_pass(
            dof, vf, kf, gf, seq_lens, scale=scale, reverse=False,
            initial_state=h0.transpose(-1, -2) if h0 is not None else None,
            dot_x=qf if want_dg else None,
        )
        dv, dh0, _ = chunk_pass(
            kf, qf, dof, gf, seq_lens, scale=scale, reverse=True,
            initial_state=dht_scaled, store_final_state=want_dh0,
        )
        dh0 = dh0 * scale if dh0 is not None else None
        dk, _, k_dk = chunk_pass(
            vf, dof, qf, gf, seq_lens, scale=scale, reverse=True,
            initial_state=dht_scaled.transpose(-1, -2) if dht is not None else None,
            dot_x=kf if want_dg else None,
        )
        dg = None
        if want_dg:
            db = q_dq - k_dk  # [B*T, H]
            if dht is not None and ht is not None:
                ends = torch.tensor(seq_lens, device=db.device).cumsum(0) - 1  # [N]
                db[ends] += (dht * ht).sum((-1, -2))  # [N, H, K, V] -> [N, H]
            dg = reverse_cumsum(db, seq_lens).view(B, T, H).to(gf.dtype)  # [B*T, H] -> [B, T, H]
        return (
            dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, H, V),
            dg, dh0, None, None, None,
        )


def linear_attn_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Triton form of `linear_attn` (inputs already validated, scale resolved).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None; initial_state: [N, H, K, V];
    cu_seqlens: int [N + 1] with B == 1, handled natively (no per-sequence loop). One token per
    sequence without gradients (decoding) runs the fused step on a copy of the state. Returns
    `(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 or None)`.
    """
    return kernel_call(
        (q, k, v), g, initial_state, output_final_state, cu_seqlens,
        scale=scale, step=linear_attn_step_inplace, function=LinearAttnFunction,
    )
