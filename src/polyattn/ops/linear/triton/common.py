"""Shared pieces of the linear-attention Triton kernels: the dot helper, the segment table, the config.

Every kernel in this package computes one *pass* of chunked linear attention over three
per-token operands `a, b: [N_tok, H, DA]`, `c: [N_tok, H, DC]` and an optional log-decay
`g: [N_tok, H]` (tokens of all sequences flattened, as with `cu_seqlens`):

    causal      out_i = scale * [sum_{j <= i} exp(G_i - G_j) (a_i . b_j) c_j + exp(G_i) a_i^T S_0]
    anticausal  out_i = scale * [sum_{j >= i} exp(G_j - G_i) (a_i . b_j) c_j + exp(G_end - G_i) a_i^T R_end]

with `G` the inclusive cumulative sum of `g` inside the sequence and `S_0, R_end: [DA, DC]`. The forward of `linear_attn`
is the causal pass `(a, b, c) = (q, k, v)`; its backward is one causal pass `(do, v, k) -> dq`
and two anticausal passes `(k, q, do) -> dv` and `(v, do, q) -> dk` (see `function.py`).

A sequence is cut into *segments* of whole chunks so that enough programs exist to fill the
GPU when `N * H` is small: `chunk_states.py` computes each segment's local end state,
`segment_scan_kernel` combines them sequentially per sequence (the associative combine
`(G1, S1), (G2, S2) -> (G1 + G2, exp(G2) S1 + S2)` of `ops.common.scan.combine_decayed`),
and `chunk_outputs.py` runs each segment with its true incoming state kept on chip.
"""
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Segment flags stored in column 3 of the segment table.
FIRST = 1  # the segment starts its sequence
LAST = 2  # the segment ends its sequence


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters shared by every pass (no autotuning: the interpreter cannot run it).

    chunk_size: tokens per chunk C; block_c: tile of the DC (value) dimension per program;
    programs_per_sm: the segment split aims at this many programs per multiprocessor.
    """

    chunk_size: int = 64
    block_c: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 4
    min_segment_chunks: int = 4


_CONFIG = [KernelConfig()]


def get_config() -> KernelConfig:
    """The launch parameters in force."""
    return _CONFIG[0]


@contextmanager
def use_config(config: KernelConfig):
    """Run the enclosed launches with `config` (tests force segment splits, benchmarks sweep)."""
    previous = _CONFIG[0]
    _CONFIG[0] = config
    try:
        yield config
    finally:
        _CONFIG[0] = previous


def dot_f32(dtype: torch.dtype) -> bool:
    """Run `tl.dot` on fp32 operands: for fp32 inputs (IEEE precision) and under the
    interpreter, whose bf16 `tl.dot` is wrong; operands are rounded to the input dtype first,
    so the interpreter reproduces the GPU's bf16/fp16 rounding."""
    return dtype == torch.float32 or interpreting()


@triton.jit
def mma(x, y, F32: tl.constexpr):
    """`x @ y` accumulated in fp32; x, y already hold input-dtype values."""
    if F32:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision="ieee")
    return tl.dot(x, y)


@triton.jit
def mma_left_fp32(x, y, F32: tl.constexpr):
    """`x @ y` for an fp32 `x` and an input-dtype `y`: x is split as `hi + lo`, two input-dtype
    values (hi = x rounded, lo = the rounding error rounded), so the product keeps ~16 mantissa
    bits of x instead of 8 (bf16) for the price of a second tensor-core product."""
    if y.dtype == tl.float32:
        return tl.dot(x, y, input_precision="ieee")
    x_hi = x.to(y.dtype)  # downcast: high part
    x_lo = (x - x_hi.to(tl.float32)).to(y.dtype)  # downcast: rounding error of the high part
    return mma(x_hi, y, F32) + mma(x_lo, y, F32)


@triton.jit
def mma_right_fp32(x, y, F32: tl.constexpr):
    """`x @ y` for an input-dtype `x` and an fp32 `y` (the state), split like `mma_left_fp32`."""
    if x.dtype == tl.float32:
        return tl.dot(x, y, input_precision="ieee")
    y_hi = y.to(x.dtype)  # downcast: high part
    y_lo = (y - y_hi.to(tl.float32)).to(x.dtype)  # downcast: rounding error of the high part
    return mma(x, y_hi, F32) + mma(x, y_lo, F32)


@triton.jit
def to_output(x, dtype: tl.constexpr, F32: tl.constexpr):
    """Downcast fp32 `x` to the output dtype, rounding to nearest even. The interpreter
    truncates fp32 -> bf16 (F32 and bf16 only meet there), so there the rounding is done on
    the bits first and the cast is exact."""
    if F32 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


_TABLES: dict = {}


def segment_table(seq_lens: tuple, num_segments_hint: int, chunk_size: int, device):
    """Cut each sequence into segments of whole chunks.

    seq_lens: per-sequence lengths (host ints); num_segments_hint: wanted segments per sequence
    (1 = no split). Returns `(table [S, 4] int32 (bos, eos, sequence, flags), cu_segments
    [N + 1] int32, S)`; tables are cached per (lengths, hint, chunk, device).
    """
    key = (seq_lens, num_segments_hint, chunk_size, str(device))
    if key in _TABLES:
        return _TABLES[key]
    rows, cu = [], [0]
    bos = 0
    for n, length in enumerate(seq_lens):
        chunks = triton.cdiv(length, chunk_size)
        per_segment = triton.cdiv(chunks, max(1, min(num_segments_hint, chunks)))
        seg_len = per_segment * chunk_size
        starts = list(range(0, length, seg_len)) or [0]
        for i, s in enumerate(starts):
            flags = (FIRST if i == 0 else 0) | (LAST if i == len(starts) - 1 else 0)
            rows.append((bos + s, bos + min(s + seg_len, length), n, flags))
        cu.append(cu[-1] + len(starts))
        bos += length
    table = torch.tensor(rows, dtype=torch.int32).to(device)  # [S, 4]
    cu_segments = torch.tensor(cu, dtype=torch.int32).to(device)  # [N + 1]
    if len(_TABLES) > 256:
        _TABLES.clear()
    _TABLES[key] = (table, cu_segments, len(rows))
    return _TABLES[key]


def plan_segments(seq_lens: tuple, H: int, DC: int, config: KernelConfig, device) -> int:
    """Segments per sequence so that `programs = segments * H * cdiv(DC, block_c)` fills the GPU."""
    base = len(seq_lens) * H * triton.cdiv(DC, config.block_c)
    target = config.programs_per_sm * num_sms(device)
    if base >= target:
        return 1
    longest = max(seq_lens)
    max_segments = max(1, triton.cdiv(longest, config.chunk_size * config.min_segment_chunks))
    return min(triton.cdiv(target, base), max_segments)
