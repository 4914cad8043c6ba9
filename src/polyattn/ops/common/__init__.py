"""Shared machinery of every mechanism: validation, dispatch, varlen, segment sums, chunking, scans, levels."""

from polyattn.ops.common.causal import causal_matmul
from polyattn.ops.common.chunking import heads_chunks, heads_unchunk, pad_time, to_chunks
from polyattn.ops.common.dispatch import FORMS, one_token_step, resolve_impl, wants_grad
from polyattn.ops.common.dtypes import compute_dtype
from polyattn.ops.common.fenwick import level, level_matrix, level_table, num_levels
from polyattn.ops.common.scan import associative_reduce, associative_scan, carry_decayed, combine_decayed
from polyattn.ops.common.segsum import causal_mask, causal_scores, exp_segsum, scaled_log_decay, segsum, suffix_sum
from polyattn.ops.common.validate import (
    Dims,
    check_choice,
    check_inputs,
    check_cu_seqlens,
    check_flag,
    check_log_decay,
    check_per_token,
    check_positive,
    check_qkv,
    check_state,
    check_value,
    resolve_scale,
    set_value_checks,
)
from polyattn.ops.common.varlen import run_padded_batches, run_varlen, run_with_resets, state_cat, state_index, state_take

__all__ = [
    "Dims",
    "FORMS",
    "associative_reduce",
    "associative_scan",
    "carry_decayed",
    "causal_mask",
    "causal_matmul",
    "causal_scores",
    "check_choice",
    "check_cu_seqlens",
    "check_flag",
    "check_inputs",
    "check_log_decay",
    "check_per_token",
    "check_positive",
    "check_qkv",
    "check_state",
    "check_value",
    "combine_decayed",
    "compute_dtype",
    "exp_segsum",
    "heads_chunks",
    "heads_unchunk",
    "level",
    "level_matrix",
    "level_table",
    "num_levels",
    "one_token_step",
    "wants_grad",
    "pad_time",
    "resolve_impl",
    "resolve_scale",
    "run_padded_batches",
    "run_varlen",
    "run_with_resets",
    "scaled_log_decay",
    "segsum",
    "set_value_checks",
    "state_cat",
    "state_index",
    "state_take",
    "suffix_sum",
    "to_chunks",
]
