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

from polyattn.ops.triton.plan import device_lengths, kernel_call, no_output, reverse_cumsum

from .launch import chunk_pass
from .step import linear_attn_step_inplace


@torch.library.custom_op("polyattn::linear_attn_forward", mutates_args=())
def linear_attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, h0: torch.Tensor | None,
    scale: float, seq_lens: list[int], store_ht: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward pass as a custom op (torch.compile sees one opaque call). Returns `(o [B, T, H, V],
    ht [N, H, K, V] fp32, or an empty [0] tensor without store_ht)`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    qf, kf, vf = (x.reshape(B * T, H, x.shape[-1]).contiguous() for x in (q, k, v))  # [B, T, H, D] -> [B*T, H, D]
    gf = g.reshape(B * T, H).contiguous() if g is not None else None  # [B, T, H] -> [B*T, H]
    o, ht, _ = chunk_pass(
        qf, kf, vf, gf, tuple(seq_lens), scale=scale, reverse=False,
        initial_state=h0.contiguous() if h0 is not None else None, store_final_state=store_ht, guard=True,
        rounded_updates=True,
    )
    return o.view(B, T, H, V), (ht if ht is not None else no_output(q))  # [B*T, H, V] -> [B, T, H, V]


@linear_attn_forward.register_fake
def _(q, k, v, g, h0, scale, seq_lens, store_ht):
    B, T, H, K = q.shape
    V = v.shape[-1]
    ht = q.new_empty(len(seq_lens), H, K, V, dtype=torch.float32) if store_ht else no_output(q)
    return v.new_empty(B, T, H, V), ht


@torch.library.custom_op("polyattn::linear_attn_backward", mutates_args=())
def linear_attn_backward(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor | None, h0: torch.Tensor | None, ht: torch.Tensor | None,
    scale: float, seq_lens: list[int], want_dg: bool, want_dh0: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three backward passes and dg as a custom op: `(dq, dk, dv, dg, dh0)`, dg and dh0 empty
    [0] tensors when not wanted."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    seq_lens = tuple(seq_lens)
    qf, kf, vf = (x.reshape(B * T, H, x.shape[-1]).contiguous() for x in (q, k, v))  # [B, T, H, D] -> [B*T, H, D]
    gf = g.reshape(B * T, H).contiguous() if g is not None else None  # [B, T, H] -> [B*T, H]
    dof = do.reshape(B * T, H, V).contiguous()  # [B, T, H, V] -> [B*T, H, V]
    dht_scaled = dht / scale if dht is not None else None  # [N, H, K, V], the reverse state's units
    dq, _, q_dq = chunk_pass(
        dof, vf, kf, gf, seq_lens, scale=scale, reverse=False,
        initial_state=h0.transpose(-1, -2) if h0 is not None else None,
        dot_x=qf if want_dg else None,
    )
    dv, dh0, _ = chunk_pass(
        kf, qf, dof, gf, seq_lens, scale=scale, reverse=True,
        initial_state=dht_scaled, store_final_state=want_dh0,
    )
    dk, _, k_dk = chunk_pass(
        vf, dof, qf, gf, seq_lens, scale=scale, reverse=True,
        initial_state=dht_scaled.transpose(-1, -2) if dht is not None else None,
        dot_x=kf if want_dg else None,
    )
    dg = no_output(q)
    if want_dg:
        db = q_dq - k_dk  # [B*T, H]
        if dht is not None and ht is not None:
            ends = device_lengths(seq_lens, db.device).cumsum(0) - 1  # [N]
            db[ends] += (dht * ht).sum((-1, -2))  # [N, H, K, V] -> [N, H]
        dg = reverse_cumsum(db, seq_lens).view(B, T, H).to(g.dtype)  # [B*T, H] -> [B, T, H]
    dh0 = dh0 * scale if dh0 is not None else no_output(q)
    return dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, H, V), dg, dh0


@linear_attn_backward.register_fake
def _(do, dht, q, k, v, g, h0, ht, scale, seq_lens, want_dg, want_dh0):
    dg = g.new_empty(g.shape) if want_dg else no_output(q)
    dh0 = h0.new_empty(h0.shape, dtype=torch.float32) if want_dh0 else no_output(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dg, dh0


def _setup_context(ctx, inputs, output):
    q, k, v, g, h0, scale, seq_lens, store_ht = inputs
    ctx.save_for_backward(q, k, v, g, h0, output[1] if store_ht else None)
    ctx.scale, ctx.seq_lens = scale, seq_lens


def _backward(ctx, do, dht):
    q, k, v, g, h0, ht = ctx.saved_tensors
    want_dg = g is not None and ctx.needs_input_grad[3]
    want_dh0 = h0 is not None and ctx.needs_input_grad[4]
    dht = dht if dht is not None and dht.numel() else None
    dq, dk, dv, dg, dh0 = linear_attn_backward(do, dht, q, k, v, g, h0, ht, ctx.scale, ctx.seq_lens, want_dg, want_dh0)
    return dq, dk, dv, dg if want_dg else None, dh0 if want_dh0 else None, None, None, None


linear_attn_forward.register_autograd(_backward, setup_context=_setup_context)


def _apply(q, k, v, g, initial_state, scale, seq_lens, output_final_state):
    """The chunk kernels through the custom ops (the final state only when it is asked for: the
    backward needs it only with its gradient)."""
    o, ht = linear_attn_forward(q, k, v, g, initial_state, scale, list(seq_lens), output_final_state)
    return o, (ht if output_final_state else None)


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
        scale=scale, step=linear_attn_step_inplace, function=_apply,
    )
