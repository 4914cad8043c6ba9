"""Host-side planning shared by every kernel: launch configuration, segment and chunk tables.

Packed sequences (`cu_seqlens`) are laid end to end as `N_tok` tokens. A *segment* is a run of
whole chunks of one sequence owned by one program; a sequence is cut into several segments when
`N * H` programs would leave the GPU idle, and the segments' boundary states are combined by
the family's associative combine. A *chunk table* is the segment table with one chunk per row:
the grid of the per-chunk parallel kernels.
"""
import itertools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from polyattn.ops.common import one_token_step

from .precision import check_kernel_inputs

# Segment flags stored in column 3 of the segment table.
FIRST = 1  # the segment starts its sequence
LAST = 2  # the segment ends its sequence


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters shared by every pass (no autotuning: the interpreter cannot run it).

    chunk_size: tokens per chunk C; block_c: tile of the DC (value) dimension per program of a
    linear-attention pass; programs_per_sm: the segment split aims at this many programs per
    multiprocessor, and runs only while the unsplit programs number at most split_fill per multiprocessor (two
    programs of the pass fit on one at once; on the H200 at 8K tokens per sequence, 256 programs on 132
    multiprocessors, three segments each took a fwd+bwd of linear attention from 2.09 to 2.58 ms and with decay from
    5.38 to 6.24, while at 32K, 64 programs, nine segments each beat three by 4 to 11%:
    benchmarks/results/2026-12-04-h200/tune-linear-programs.json; on an H100, eight programs per multiprocessor
    beat four, twelve and sixteen at 32K and 128K, a fwd+bwd with decay at 128K 11.55 ms at four, 10.30 at eight:
    benchmarks/results/2026-12-06-h100/tune-programs*.json). states_block_c and states_warps are the value tile and
    warps of a split pass's local-state kernel (`segment_states_kernel`; None: block_c and num_warps), whose programs
    each read every key of their segment: at 64-column tiles and 128 values each key is read twice. 128 columns at 4
    warps took a fwd+bwd of linear attention with decay from 5.05 / 9.46 to 4.87 / 9.03 ms at 32K / 128K tokens on an
    H100 (8 warps: 5.18 / 9.76; the forwards within 3%: benchmarks/results/2026-12-07-h100/tune-states-call43.txt); ptxas
    counts 251 registers and no spills at 4 warps (benchmarks/results/triton-spills-sm90a.txt). level_programs_per_sm:
    log-linear attention's level pass narrows its value tiles while its programs number fewer than this many per
    multiprocessor; level_wide_warps are the warps of its 64-column (or wider) tiles, narrower ones run num_warps
    (ptxas for sm_90a at K = 128 and 64-column tiles: 768 / 1,152 / 852 / 860 bytes of spills a thread for the
    forward / dq / dv / dk passes at 4 warps, 64 / 316 / 84 / 84 at 8: benchmarks/results/triton-spills-sm90a.txt;
    on an H100 a forward + backward of log-linear Mamba-2 took 23.95 / 30.41 / 45.25 / 140.0 ms at 2K / 8K / 32K /
    128K against 26.33 / 36.27 / 44.76 / 139.7 at 4 warps and four programs per multiprocessor, while 8 warps on the
    narrowed tiles took 58.76 at 8K and 70.46 at 32K: benchmarks/results/2026-12-07-h100/tune-levels-call5{5,6}.txt).
    decay_update_dot is how the forward of `linear_attn` with decay, when no final state is asked for, feeds its
    state update `keys^T @ (values * decay)` to the tensor cores on bf16/fp16 inputs (`precision.UPDATE_DOTS`,
    chunk_states.update_dot; every other pass splits):
    "rounded", the default, one product of the decayed values rounded to the input dtype (o's error at most 1.3x the
    split's, under the interpreter at the tests' CPU shapes, six seeds); "split" two products of their halves (on the H200 at 8K tokens the forward took 0.85 ms
    split, 0.72 rounded: benchmarks/results/2026-12-04-h200/tune-update-dot-call10.json). Log-linear Mamba-2's forward
    level pass, when no final state is asked for, takes its adds so too (its reads of the level states stay split); on
    an H100 the forward took 4.93 / 6.40 / 9.32 / 31.44 ms at 2K / 8K / 32K / 128K against 5.26 / 6.68 / 9.84 / 33.46
    split (benchmarks/results/2026-12-07-h100/tune-levels-adds-call58.txt). The delta rule's kernels hold more fp32 tiles
    per program (the solve matrix, the pseudo-values, their split halves): delta_block_v is the value tile of their two recurrences,
    delta_num_warps their warps (the H200 profile: value tile 32 beat 64 by 1.25x at 4 warps),
    delta_out_block_v the value tile of the per-chunk output kernel and delta_chunk_warps the warps
    of the per-chunk output and gradient kernels (4: the two gradient kernels spill more at 4 warps
    than at 8, yet a forward + backward took 13.5 ms at 4 against 17.9 at 8 on the H200); delta_grad_block_v
    the value tile of the two per-chunk gradient kernels and delta_grad_block_k the key tile of the second (32 and 64:
    on the H200 at 8K tokens a forward + backward took 11.31 ms, 12.65 with value tiles of 64, 15.18 with key tiles of
    128, and value tiles of 128 ran out of shared memory: benchmarks/results/2026-12-04-h200/tune-delta-grad-tiles-call13.txt); delta_fp32_dot how their fp32 x fp32
    products run on bf16/fp16 inputs (`precision.FP32_DOTS`: "split", the default, keeps the
    tests' error bound; "rounded" trades accuracy for fewer tensor-core products and is there to be measured:
    at the GPU test shape dg's error is 1.9x its bound, 2026-12-06-h100/delta-precision-call8.json. A third mode, one
    tf32 product, was slower at 8K on an H100 (fwd+bwd 12.05 against 11.85 ms: tune-delta-bv16-tf32-call7.txt) and
    gave a non-finite dk at that shape (delta-precision-call8.json), so it was taken out); delta_out_dot the same
    choice for the two products that form the outputs alone (score tile times U, queries times the entering state;
    off the recurrence's dependent path, and nothing of the backward reads them): "rounded" by default, as the linear
    forward's decay_update_dot, since o is rounded to the input dtype anyway (at the GPU test shape o's error 2.6e-3
    against 2.0e-3 split, bound 6.3e-3, every other tensor unchanged; on an H100 the forward took 2.18 ms against
    2.43 at 8K, 3.08 against 3.57 at 32K: 2026-12-07-h100/delta-precision-call51.txt, tune-delta-outdot-call51.txt); delta_fused_outputs whether the recurrence forms the outputs (None: when its
    programs outnumber the multiprocessors; on the H200 fused took 2.95 / 2.94 ms against 3.29 / 3.26 at
    2K / 8K tokens per sequence, 4.10 / 13.9 against 4.07 / 11.8 at 32K / 128K with 128 / 64 walks:
    tune-delta-fused-outputs-call29.json; on an H100 at 32K with 256 walks of 16 columns, 3.64 ms and 0.50 GiB fused
    against 3.75 and 2.00: 2026-12-06-h100/tune-delta-narrow-call8.txt). delta_split_per_sm
    cuts sequences into segments of whole chunks, aiming at this many recurrence programs per multiprocessor (0:
    never), when the unsplit walks would fill at most delta_split_fill of the multiprocessors; the reverse recurrence
    too only with delta_split_backward (ops/delta/README.md, "Segments": on the H200 the split took the forward at
    128K from 12.57 to 9.83 ms and its peak from 4.0 to 1.0 GiB, but with the reverse one split too the fwd+bwd from
    34.5 to 37.0 ms, and the forward at 32K, whose 128 walks fill the GPU, from 4.17 to 4.70: tune-delta-split.json).
    An unsplit recurrence halves its value tile (down to 16) while its walks number at most delta_narrow_per_sm per
    multiprocessor (0: never; delta.triton.function.value_tile): on an H100 value tiles of 16 everywhere took the
    32K fwd+bwd from 12.42 to 11.90 ms and the 128K one from 32.54 to 29.01, but the 8K one from 11.85 to 12.34, where
    the walks fill the GPU (benchmarks/results/2026-12-06-h100/tune-delta-bv16-tf32-call7.txt); narrowed only below
    one walk per multiprocessor, the 32K forward took 3.75 ms against 4.29 and the fwd+bwd at 32K / 128K 11.72 /
    30.14 against 12.17 / 32.06, 2K and 8K unchanged (tune-delta-narrow-call8.txt).
    KATA's quadratic kernels (ops/kata/triton) tile queries by kata_block_m and keys by kata_block_n (kata_block_m a multiple of it: kata_block_m / kata_block_n
    key tiles per diagonal; both for G <= 2 groups and bf16/fp16, divided by G / 2 for more groups and
    by 2 for fp32 inputs, at least 16: ops/kata/README.md, "Forward tiling"), run kata_num_warps (forward) and kata_bwd_warps (the two gradient kernels) warps
    with kata_num_stages pipeline stages; kata_score_dot is how their fp32 tiles (scores, score
    gradients) enter the bf16/fp16 products with values, keys and queries: "split" (the default,
    the tests' error bound) in two halves, precision.mma_left_fp32, two products with ~16
    mantissa bits; "rounded" one product of the rounded tile (flash attention's precision).
    KATA's chunked form (ops/kata/triton/chunk.py) cuts sequences into state chunks of kata_chunk_size
    tokens (a multiple of kata_block_m, kata_block_n and kata_read_block; inside a chunk the quadratic
    kernel runs), walks them in sub-tiles of kata_block_n tokens with blocks of about kata_state_block
    lifted features per program, reads the states (and forms the backward's lift gradients) in tiles of
    kata_read_block tokens, and runs these kernels with kata_chunk_warps warps, its backward's reverse walk
    included (on the H200 at 128K tokens the reads took 10.3 / 6.4 ms for KATA-M2 in tiles of 64 / 128
    tokens: benchmarks/results/2026-12-02-h200/kata-chunk-probe.json), the read and lift-gradient kernels in
    kata_read_stages pipeline stages and the walks in kata_num_stages (at 128K tokens the M2 read took 6.0 /
    6.5 / 4.8 / 4.8 ms at 1 / 2 / 3 / 4 stages, the reverse walk 47.9 / 7.7 / 8.2 ms at 1 / 2 / 3:
    benchmarks/results/2026-12-03-h200/kata-chunk-kernels-*stages.json); `impl="triton"` takes it, with
    or without gradients, from kata_chunk_crossover·(P + 1024) tokens per sequence (P lifted features; a fit to
    the H200's crossovers at K = V = 64: forward about 11K tokens for KATA-M2, 8.6K for Σ2, 21K for M1;
    forward + backward 8K for M2, 23K for M1). Maps of kata_wide_features lifted features or more (KATA-M1 at
    K = 64) take state chunks of kata_wide_chunk_size instead: half the stored states (on the H200 at 128K tokens
    KATA-M1's fwd+bwd peaked at 4.16 GiB in chunks of 1,024 against 6.19 in chunks of 512, 2.74x and 4.08x SDPA
    flash's, in 102.6 against 103.2 ms; KATA-M2 at 1,024 took 54.6 against 51.8 ms, so it keeps 512:
    benchmarks/results/2026-12-03-h200/kata-chunk1024-peak.json).
    DeltaKATA's chunked walk (ops/kata/triton/delta.py) solves chunks of deltakata_chunk_size tokens (a power of
    two, at least 16) and runs one program per value tile of at most deltakata_block_v columns (halved to 16 while
    the walks are fewer than the multiprocessors), with kata_chunk_warps warps (on the H200, DeltaKATA-M1 at 8K x 8:
    a forward + backward took 161 ms in chunks of 128 and tiles of 32 at 4 warps, 190 at 8; chunks of 128 keep 35 %
    less memory than chunks of 64 at the same speed: benchmarks/results/2026-12-03-h200/deltakata-chunk-sweep.json).
    Its forward keeps the state entering every deltakata_state_interval-th chunk of a sequence for the backward, which
    recomputes the others round by round (None: ⌈√(c / 2)⌉ for c chunks, the least memory; 1: every state kept and
    none recomputed, the fastest backward; delta.state_interval). deltakata_algebra_kernels runs the chunk-local
    algebra and the walk's `[C, C]` gradients as Triton kernels (ops/kata/triton/algebra.py) instead of PyTorch:
    off, since on an H100 the algebra's forward kernel took DeltaKATA-M1's forward at 2K x 32 from 42.5 to 96.8 ms
    (ops/kata/README.md, "The chunk-local algebra as kernels").
    gdn_block_v and gdn_num_warps are the value tile and warps of log-linear Gated DeltaNet's level
    walks, forward and backward (ops/loglinear/triton/gdn.py). 4 warps: on an H100 at 8K / 32K tokens a forward
    took 12.6 / 17.8 ms at 4 against 17.0 / 20.5 at 8, a forward + backward 104.7 / 138.6 against 114.5 / 141.8
    (benchmarks/results/2026-12-06-h100/tune-gdn-rounds-call21.txt; 64-column tiles at 8 warps: 108.0 / 167.0),
    though ptxas for sm_90a at K = 128 and 32-column tiles counts more spills at 4, 52 / 496 bytes a thread for
    the forward walk / the chain against 8 / 200 at 8 (benchmarks/results/triton-spills-sm90a.txt).
    gdn_chain_warps are the warps of the backward's chain (`gdn_levels_chain_kernel`, a program per level and part,
    value tiles of at least 64; 8: a forward + backward at 8K took 83.1 ms against 86.9 at 4 on an H100, call 35,
    and on the H200 at 32K 109.8 against 111.8, benchmarks/results/2026-12-06-h200/).
    gdn_grads_warps are the warps of the backward's per-chunk level gradients (`gdn_levels_grads_kernel`; 8: a
    forward + backward took 117.5 / 146.2 ms at 4, call 21) and gdn_grads_block_v their value tile (the states
    they read are whole `[K, V]`, so it need not match the walks'; 32: a forward + backward took 105.0 / 138.2 ms at
    32, 106.7 / 140.6 at 64, 117.5 / 155.4 at 128 and 168.4 / 223.4 at 128 with 16 warps, and at 128 with 8 warps
    fp32 inputs need more shared memory than an H100 has: tune-gdn-grads-tile-call23.txt,
    test_gdn_grads_tile_gpu-call23.log in the same folder). gdn_state_interval is the chunks between the level
    states the forward keeps for the backward (None: the integer square root of the longest sequence's grid rows,
    11 / 22 at 8K / 32K; gdn.checkpoint_plan; 6 and 32 took the same time, 32 with more memory, call 21).
    gdn_chunk_warps are the warps
    of its per-chunk kernels (8; at K = 128 a forward + backward took the same time at 4 and 8 when the chunk
    gradients were one kernel; its three stages now spill 0 / 500 / 0 bytes a thread at 8 warps and several
    hundred to 2 KB at 4: benchmarks/results/triton-spills-sm90a.txt. The illegal
    memory accesses of small heads came from narrow or partly masked tiles at either count, not from the
    warps: gdn.kernel_heads). gdn_heads is how many heads its forward and backward run at once (None: all): each
    group of heads runs the whole pass alone, so the fp32 work tensors (W, Ū, q̃, Tinv, the checkpoints, the
    backward's round states and level gradients, most of the peak) exist for one group at a time, at the cost
    of fewer programs per launch (on an H100 at the standard shape, 2K / 8K / 32K, groups of 2 took a forward +
    backward's peak from 7.47 / 6.30 / 5.52 to 2.30 / 2.07 / 1.94 GiB and its time from 75.3 / 97.1 / 131.9 to
    82.1 / 153.0 / 510.5 ms: benchmarks/results/2026-12-06-h100/tune-gdn-heads-split-call31.txt).
    """

    chunk_size: int = 64
    block_c: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 8
    states_block_c: int | None = 128
    states_warps: int | None = None
    level_programs_per_sm: int = 1
    level_wide_warps: int = 8
    split_fill: float = 1.0
    decay_update_dot: str = "rounded"
    min_segment_chunks: int = 4
    delta_block_v: int = 32
    delta_num_warps: int = 4
    delta_out_block_v: int = 64
    delta_chunk_warps: int = 4
    delta_grad_block_v: int = 32
    delta_grad_block_k: int = 64
    delta_fp32_dot: str = "split"
    delta_out_dot: str = "rounded"
    delta_fused_outputs: bool | None = None
    delta_split_per_sm: int = 4
    delta_split_fill: float = 0.5
    delta_split_backward: bool = False
    delta_narrow_per_sm: float = 1.0
    kata_block_m: int = 128
    kata_block_n: int = 64
    kata_num_warps: int = 8
    kata_bwd_warps: int = 8
    kata_num_stages: int = 2
    kata_score_dot: str = "split"
    kata_chunk_size: int = 512
    kata_wide_chunk_size: int = 1024
    kata_wide_features: int = 4096
    kata_state_block: int = 128
    kata_chunk_warps: int = 4
    kata_read_block: int = 128
    kata_read_stages: int = 3
    kata_chunk_crossover: float = 4.0
    deltakata_chunk_size: int = 128
    deltakata_block_v: int = 32
    deltakata_state_interval: int | None = None
    deltakata_algebra_kernels: bool = False
    gdn_block_v: int = 32
    gdn_num_warps: int = 4
    gdn_chain_warps: int = 8
    gdn_grads_warps: int = 8
    gdn_grads_block_v: int = 32
    gdn_state_interval: int | None = None
    gdn_chunk_warps: int = 8
    gdn_heads: int | None = None


_CONFIG = [KernelConfig()]


def kata_state_chunk(config: KernelConfig, P: int) -> int:
    """The state chunk of KATA's chunked form for a map of P lifted features (KernelConfig's docstring)."""
    return config.kata_wide_chunk_size if P >= config.kata_wide_features else config.kata_chunk_size


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


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def state_tile(i_c, DA, DC, BA: tl.constexpr, BC: tl.constexpr):
    """The `[BA, BC]` state tile of a program that owns DC tile `i_c` and the whole padded DA:
    `(o_a [BA], o_c [BC], m_a, m_c, m_s [BA, BC])` offsets and masks."""
    o_a = tl.arange(0, BA)
    o_c = i_c * BC + tl.arange(0, BC)
    m_a = o_a < DA
    m_c = o_c < DC
    return o_a, o_c, m_a, m_c, m_a[:, None] & m_c[None, :]


@triton.jit
def chunk_tokens(bos, eos, i, n_chunks, C: tl.constexpr, REVERSE: tl.constexpr):
    """The token rows `t [C]` of the i-th chunk that a walk over the tokens `[bos, eos)` visits (the last chunk
    first when REVERSE) and their mask `t < eos`."""
    if REVERSE:
        t = bos + (n_chunks - 1 - i) * C + tl.arange(0, C)
    else:
        t = bos + i * C + tl.arange(0, C)
    return t, t < eos


def block(d: int) -> int:
    """A power-of-two tile of at least 16 covering `d`."""
    return max(16, triton.next_power_of_2(d))


def sequence_lengths(cu_seqlens: torch.Tensor | None, B: int, T: int) -> tuple:
    """Host lengths of the sequences laid end to end (one host read of `cu_seqlens`)."""
    if cu_seqlens is None:
        return (T,) * B
    bounds = cu_seqlens.tolist()
    return tuple(e - s for s, e in zip(bounds[:-1], bounds[1:]))


_TABLES: dict = {}


def segment_starts(length: int, num_segments_hint: int, chunk_size: int) -> tuple[list, int]:
    """`(starts, seg_len)`: the token offsets of one sequence's segments, whole chunks of `seg_len` tokens each
    (one segment, at 0, for an empty sequence)."""
    chunks = triton.cdiv(length, chunk_size)
    seg_len = triton.cdiv(chunks, max(1, min(num_segments_hint, chunks))) * chunk_size
    return list(range(0, length, seg_len)) or [0], seg_len


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
        starts, seg_len = segment_starts(length, num_segments_hint, chunk_size)
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


def device_ints(values: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """The integers `values` as a `[len(values)]` tensor on `device`, cached like the tables: a host-to-device
    copy synchronises the stream, which left the GPU idle for 1.2 ms of a 7.3 ms forward + backward of
    `linear_attn` with decay on the H200 when the backward built the sequence lengths on every call."""
    key = ("ints", values, dtype, str(device))
    if key not in _TABLES:
        if len(_TABLES) > 256:
            _TABLES.clear()
        _TABLES[key] = torch.tensor(values, dtype=dtype).to(device)
    return _TABLES[key]


def device_lengths(seq_lens: tuple, device) -> torch.Tensor:
    """`[N]` int64 lengths of the sequences on `device` (`device_ints`)."""
    return device_ints(tuple(seq_lens), torch.int64, device)


def sequence_starts(seq_lens: tuple, device) -> torch.Tensor:
    """`[N + 1]` int32 offsets of the sequences laid end to end (`device_ints`)."""
    return device_ints((0, *itertools.accumulate(seq_lens)), torch.int32, device)


def chunk_table(seq_lens: tuple, chunk_size: int, device):
    """One row per chunk: `(table [NC, 4], cu_chunks [N + 1], NC)`; `cu_chunks[n]` is the index
    of sequence n's first chunk, so per-chunk buffers are indexed `cu_chunks[n] + i`."""
    longest = max(seq_lens, default=1)
    return segment_table(seq_lens, triton.cdiv(longest, chunk_size), chunk_size, device)


def _grid_rows(seq_lens: tuple, chunk_size: int, device):
    """The position-free part of `grid_chunk_table`, cached like the tables: per row its sequence's
    first token, its length, the row's index within the sequence (`[NC]` int64 each), `cu_chunks`
    [N + 1] int32 and NC."""
    key = ("grid", seq_lens, chunk_size, str(device))
    if key not in _TABLES:
        rows = [triton.cdiv(n, chunk_size) + 1 for n in seq_lens]
        cu = torch.tensor([0, *itertools.accumulate(rows)])  # [N + 1]
        lengths = torch.tensor(seq_lens)  # [N]
        seq = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(rows))  # [NC]: each row's sequence
        starts = lengths.cumsum(0) - lengths  # [N]
        parts = (seq, starts[seq], lengths[seq], torch.arange(len(seq)) - cu[seq])
        if len(_TABLES) > 256:
            _TABLES.clear()
        _TABLES[key] = (*(x.to(device) for x in parts), cu.to(torch.int32).to(device), len(seq))
    return _TABLES[key]


def grid_chunk_table(seq_lens: tuple, position: torch.Tensor, chunk_size: int):
    """Chunks on the absolute grid of sequences that start at `position [N]` (device int64, never read
    on the host): `(table [NC, 4] int32 (bos, eos, offset of bos in its chunk, 0), cu_chunks [N + 1]
    int32, NC)`. Sequence n owns `cdiv(length, C) + 1` rows, enough at any offset: its first chunk is
    cut at the grid line after its start, and a row past its end is empty (bos = eos)."""
    C = chunk_size
    seq, start, n, j, cu, NC = _grid_rows(seq_lens, C, position.device)
    r = (position % C)[seq]  # [NC]: the sequence's offset in its first chunk
    lo = (j * C - r).clamp(min=0).minimum(n)
    hi = ((j + 1) * C - r).clamp(min=0).minimum(n)
    table = torch.stack([start + lo, start + hi, torch.where(j == 0, r, 0), torch.zeros_like(j)], 1)  # [NC, 4]
    return table.to(torch.int32), cu, NC


def plan_segments(seq_lens: tuple, H: int, DC: int, config: KernelConfig, device, *, block: int | None = None,
                  per_sm: int | None = None, fill: float | None = None) -> int:
    """Segments per sequence so that `programs = segments * H * cdiv(DC, block)` fills the GPU: `per_sm`
    programs per multiprocessor (default: config.block_c and config.programs_per_sm, linear attention's); 1 when
    the unsplit programs already number more than `fill` per multiprocessor (default config.split_fill)."""
    base = len(seq_lens) * H * triton.cdiv(DC, block or config.block_c)
    sms = num_sms(device)
    target = (per_sm or config.programs_per_sm) * sms
    if base >= target or base > (config.split_fill if fill is None else fill) * sms:
        return 1
    longest = max(seq_lens)
    max_segments = max(1, triton.cdiv(longest, config.chunk_size * config.min_segment_chunks))
    return min(triton.cdiv(target, base), max_segments)


def narrow_block(BD: int, D: int, programs: int, at_most: float) -> int:
    """Tile `BD` of a `D`-wide axis halved, down to 16, while `programs * cdiv(D, BD)` programs (`programs` per
    tile) number at most `at_most`: sequential walks, one per tile, that leave the GPU idle become twice as many
    narrower ones."""
    while BD > 16 and programs * triton.cdiv(D, BD) <= at_most:
        BD //= 2
    return BD


def token_cumsum(x64: torch.Tensor, width: int = 64) -> torch.Tensor:
    """Inclusive cumsum along the last dim of `x64 [H, N_tok]` (fp64) in two levels: within blocks of
    `width` tokens, then over the blocks' totals. torch scans one row per thread block, so the direct
    scan of H = 16 rows of 64K tokens occupies 16 multiprocessors (0.10 ms on the H200); the blocked
    rows fill the GPU."""
    H, N = x64.shape
    blocks = torch.nn.functional.pad(x64, (0, -N % width)).view(H, -1, width).cumsum(-1)  # [H, NB, width]
    totals = blocks[..., -1]  # [H, NB]
    before = totals.cumsum(-1) - totals  # [H, NB]: the sum of every earlier block
    return (blocks + before[..., None]).view(H, -1)[:, :N]  # [H, N_tok]


def reverse_cumsum(x: torch.Tensor, seq_lens: tuple) -> torch.Tensor:
    """Per-sequence reverse cumsum over tokens; x: [N_tok, H] fp32, summed in fp64 along the
    last (contiguous) dimension by `token_cumsum`. The log-decay gradient of every
    family is this sum of a per-token term. Returns `[N_tok, H]` fp32, contiguous (the custom ops'
    fake functions promise contiguous gradients)."""
    x64 = x.t().double()  # [N_tok, H] -> [H, N_tok]
    total = token_cumsum(x64)  # [H, N_tok]
    lengths = device_lengths(seq_lens, x.device)  # [N]
    ends = lengths.cumsum(0) - 1  # [N] last token of each sequence
    end_of = total[:, torch.repeat_interleave(ends, lengths, output_size=x.shape[0])]  # [H, N_tok]; size given: no host read
    return (end_of - total + x64).float().t().contiguous()  # [H, N_tok] -> [N_tok, H]


def prefix_cumsum(x: torch.Tensor, seq_lens: tuple) -> torch.Tensor:
    """Per-sequence inclusive cumsum over tokens, the counterpart of `reverse_cumsum` (x: [N_tok, H] fp32, summed
    in fp64): `[N_tok, H]` fp32."""
    x64 = x.t().double()  # [N_tok, H] -> [H, N_tok]
    total = token_cumsum(x64)  # [H, N_tok]
    lengths = device_lengths(seq_lens, x.device)  # [N]
    starts = lengths.cumsum(0) - lengths  # [N] first token of each sequence
    base = (total - x64)[:, torch.repeat_interleave(starts, lengths, output_size=x.shape[0])]  # [H, N_tok]: the sum before it
    return (total - base).float().t().contiguous()  # [H, N_tok] -> [N_tok, H]


def step_state(initial_state, q: torch.Tensor, V: int) -> torch.Tensor:
    """The fp32 state a one-token call steps in place: a copy of `initial_state` (the caller's
    tensor is not modified) or zeros, `[B, H, K, V]` contiguous."""
    if initial_state is not None:
        return initial_state.to(torch.float32, copy=True).contiguous()
    B, _, H, K = q.shape
    return torch.zeros(B, H, K, V, dtype=torch.float32, device=q.device)


def empty_call(q: torch.Tensor, v: torch.Tensor, initial_state, output_final_state: bool, seq_lens: tuple):
    """The result of a call with nothing to compute (no sequence, no head, or no token at all),
    as the PyTorch forms give it: an empty output, and the final state equal to the initial state
    (zeros without one). None when there is work for the kernels."""
    if q.numel() != 0:
        return None
    B, T, H, K = q.shape
    o = torch.empty(B, T, H, v.shape[-1], dtype=q.dtype, device=q.device)
    if not output_final_state:
        return o, None
    if initial_state is not None:
        return o, initial_state.to(torch.float32, copy=True)
    return o, torch.zeros(len(seq_lens), H, K, v.shape[-1], dtype=torch.float32, device=q.device)


def kernel_call(tensors: tuple, g, initial_state, output_final_state: bool, cu_seqlens, *, scale, step, function):
    """The host front of a Triton form: check the inputs, plan the sequences, answer empty calls,
    send a one-token call without gradients to the fused `step` (on a copy of the state), and
    everything else to the autograd `function` of the chunk kernels.

    tensors: `(q, k, v, ...)` per-token inputs before `g`, as both `step(*tokens, g, state, scale=)`
    and `function(*tensors, g, initial_state, scale, seq_lens, output_final_state)` take them.
    """
    q, v = tensors[0], tensors[2]
    check_kernel_inputs(q)
    seq_lens = sequence_lengths(cu_seqlens, *q.shape[:2])
    empty = empty_call(q, v, initial_state, output_final_state, seq_lens)
    if empty is not None:
        return empty
    if one_token_step(q, cu_seqlens, (*tensors, g, initial_state)):
        state = step_state(initial_state, q, v.shape[-1])
        o, state = step(*(x[:, 0] for x in tensors), None if g is None else g[:, 0], state, scale=scale)
        return o[:, None], (state if output_final_state else None)  # [B, H, V] -> [B, 1, H, V]
    o, ht = function(*tensors, g, initial_state, float(scale), seq_lens, output_final_state)
    return o, (ht if output_final_state else None)


def no_output(q: torch.Tensor) -> torch.Tensor:
    """The stand-in for an output a kernel custom op does not produce this call: a fresh empty fp32
    tensor (custom-op outputs may not alias one another or an input)."""
    return q.new_empty(0, dtype=torch.float32)
