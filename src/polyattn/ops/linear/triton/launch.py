"""One *pass* of chunked linear attention on the host: segment planning and three kernel launches.

Every kernel of this package computes one pass over three per-token operands `a, b: [N_tok, H, DA]`,
`c: [N_tok, H, DC]` and an optional log-decay `g: [N_tok, H]` (tokens of all sequences flattened,
as with `cu_seqlens`):

    causal      out_i = scale * [sum_{j <= i} exp(G_i - G_j) (a_i . b_j) c_j + exp(G_i) a_i^T S_0]
    anticausal  out_i = scale * [sum_{j >= i} exp(G_j - G_i) (a_i . b_j) c_j + exp(G_end - G_i) a_i^T R_end]

with `G` the inclusive cumulative sum of `g` inside the sequence and `S_0, R_end: [DA, DC]`. The
forward of `linear_attn` is the causal pass `(a, b, c) = (q, k, v)`; its backward is one causal
pass `(do, v, k) -> dq` and two anticausal passes `(k, q, do) -> dv` and `(v, do, q) -> dk`
(function.py). A sequence is cut into segments of whole chunks (ops/triton/plan.py) when `N * H`
is small: `chunk_states.py` computes each segment's local end state and combines them
sequentially per sequence (`(G1, S1), (G2, S2) -> (G1 + G2, exp(G2) S1 + S2)`, the combine of
`ops.common.scan.combine_decayed`), and `chunk_outputs.py` runs each segment with its true
incoming state kept on chip.
"""
import torch
import triton

from .chunk_outputs import chunk_outputs_kernel
from .chunk_states import segment_scan_kernel, segment_states_kernel, update_dot
from polyattn.ops.triton.plan import KernelConfig, block, get_config, plan_segments, segment_table
from polyattn.ops.triton.precision import dot_f32


def state_rows(BA: int) -> int:
    """The rows of a pass's state tile: from BA = 128 on, half of BA (the `[BA, BC]` state is held as two tiles,
    each split into its tensor-core halves alone: fewer live registers, ops/linear/README.md "Where the decay's
    time goes"), else BA."""
    return BA // 2 if BA >= 128 else BA


def chunk_pass(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    g: torch.Tensor | None,
    seq_lens: tuple,
    *,
    scale: float,
    reverse: bool,
    initial_state: torch.Tensor | None = None,
    store_final_state: bool = False,
    dot_x: torch.Tensor | None = None,
    guard: bool = False,
    rounded_updates: bool = False,
    config: KernelConfig | None = None,
):
    """Run one chunked pass over flattened tokens.

    a, b: [N_tok, H, DA]; c, dot_x: [N_tok, H, DC]; g: [N_tok, H] or None; all contiguous.
    seq_lens: host lengths of the N sequences laid end to end. initial_state: [N, H, DA, DC]
    (any strides), the causal S_0 or the anticausal R_end. guard: keep a non-finite row of b or c
    out of every earlier output (causal passes; chunk_outputs.py). rounded_updates: with decay and no
    final state stored, the state updates may take rounded decayed values (`chunk_states.update_dot`).
    config: default `get_config()`. Returns `(out [N_tok, H, DC] in c's dtype, final_state [N, H, DA, DC]
    fp32 or None, rowdot [N_tok, H] fp32 or None)`.
    """
    config = config or get_config()
    N_tok, H, DA = a.shape
    DC = c.shape[-1]
    N = len(seq_lens)
    BA, BC, C = block(DA), min(block(DC), config.block_c), config.chunk_size
    n_c = triton.cdiv(DC, BC)
    F32 = dot_f32(a.dtype)
    UPDATE_DOT = update_dot(config, rounded=rounded_updates and not store_final_state)
    hint = plan_segments(seq_lens, H, DC, config, a.device)
    seg, cu_seg, S = segment_table(seq_lens, hint, C, a.device)
    split = S > N
    out = torch.empty_like(c)
    final_state = torch.empty(N, H, DA, DC, dtype=torch.float32, device=a.device) if store_final_state else None
    if initial_state is not None and final_state is not None:
        assert initial_state.stride() == final_state.stride(), "h0 and ht share strides"
    strided = initial_state if initial_state is not None else final_state
    strides = tuple(strided.stride()) if strided is not None else (0, 0, 0, 0)
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    s_in = None
    nonfinite = torch.empty(n_c * S * H, dtype=torch.int32, device=a.device) if guard else None
    if split:
        s_in = torch.empty(S, H, DA, DC, dtype=torch.float32, device=a.device)
        seg_decay = torch.empty(S, H, dtype=torch.float32, device=a.device)
        BS = min(block(DC), config.states_block_c or BC)
        segment_states_kernel[(triton.cdiv(DC, BS), S, H)](
            b, c, g, seg, s_in, seg_decay, H, DA, DC,
            C=C, BA=BA, BC=BS, REVERSE=reverse, USE_G=g is not None, F32=F32, UPDATE_DOT=UPDATE_DOT, TERMINAL=guard,
            num_warps=config.states_warps or config.num_warps, num_stages=config.num_stages,
        )
        segment_scan_kernel[(n_c, N, H)](
            s_in, seg_decay, cu_seg, initial_state, nonfinite, *strides, S, H, DA, DC,
            BA=BA, BC=BC, REVERSE=reverse, USE_H0=initial_state is not None, CHECK=guard, num_warps=4,
        )
    rowdot = None
    if dot_x is not None:
        rowdot = torch.empty(n_c, N_tok, H, dtype=torch.float32, device=a.device)
    for rerun in (False, True) if guard else (False,):
        chunk_outputs_kernel[(n_c, S, H)](
            a, b, c, g, out, seg, s_in, initial_state, final_state, dot_x, rowdot, nonfinite, *strides,
            scale, N_tok, H, DA, DC,
            C=C, BA=BA, R=state_rows(BA), BC=BC, REVERSE=reverse, USE_G=g is not None, SPLIT=split,
            USE_H0=initial_state is not None, STORE_HT=store_final_state, ROWDOT=dot_x is not None,
            F32=F32, UPDATE_DOT=UPDATE_DOT, CHECK=guard and not rerun and not split, RERUN=rerun, **launch,
        )
    if rowdot is not None:
        rowdot = rowdot.sum(0)  # [n_c, N_tok, H] -> [N_tok, H]
    return out, final_state, rowdot
