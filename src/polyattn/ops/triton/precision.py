"""Precision helpers of every kernel: the log2(e) constant, fp32-faithful dots, the output downcast.

Policy (ops/README.md, "Numerics"): states and accumulators are fp32; tensor-core operands are
the input dtype. An fp32 operand (a state, a decayed tile, a solved matrix) enters a bf16/fp16
product split in two input-dtype halves, `x = hi + lo`, which keeps ~16 mantissa bits for the
price of a second product.
"""
import os

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): kernels take exp2 of log2(e)-prescaled log-decays


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_f32(dtype: torch.dtype) -> bool:
    """Run `tl.dot` on fp32 operands: for fp32 inputs (IEEE precision) and under the
    interpreter, whose bf16 `tl.dot` is wrong; operands are rounded to the input dtype first,
    so the interpreter reproduces the GPU's bf16/fp16 rounding."""
    return dtype == torch.float32 or interpreting()


def check_kernel_inputs(q: torch.Tensor) -> None:
    """The dtypes and devices the kernels run on."""
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not q.is_cuda and not interpreting():
        raise ValueError(f"expected bf16/fp16/fp32 CUDA tensors (or TRITON_INTERPRET=1), got {q.dtype} on {q.device}")


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
def mma_acc(x, y, acc, F32: tl.constexpr):
    """`acc + x @ y`, the product accumulated into `acc` (fp32); x, y already hold input-dtype values."""
    if F32:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), acc=acc, input_precision="ieee")
    return tl.dot(x, y, acc=acc)


@triton.jit
def mma_right_acc(x, y, acc, F32: tl.constexpr, MODE: tl.constexpr):
    """`acc + x @ y` for an input-dtype `x` and an fp32 `y`, each product accumulated into `acc`,
    so no `[M, N]` fp32 temporary is live beside it (a state update: the temporaries of
    `mma_right_fp32` pushed the linear passes' 4-warp programs past their registers). MODE
    (`UPDATE_DOTS`): 0 y split like `mma_right_fp32`, two products; 2 y rounded to x's dtype, one."""
    if x.dtype == tl.float32:
        return tl.dot(x, y, acc=acc, input_precision="ieee")
    y_hi = to_output(y, x.dtype, F32)  # downcast: high part (MODE 2: y rounded to the input dtype), nearest even
    acc = mma_acc(x, y_hi, acc, F32)
    if MODE == 0:
        y_lo = to_output(y - y_hi.to(tl.float32), x.dtype, F32)  # downcast: rounding error of the high part
        acc = mma_acc(x, y_lo, acc, F32)
    return acc


@triton.jit
def mma_left_acc(x, y, acc, F32: tl.constexpr):
    """`acc + x @ y` for an fp32 `x` and an input-dtype `y`, x split like `mma_left_fp32` and each
    product accumulated into `acc` (as `mma_right_acc` does for the right operand)."""
    if y.dtype == tl.float32:
        return tl.dot(x, y, acc=acc, input_precision="ieee")
    x_hi = to_output(x, y.dtype, F32)  # downcast: high part, nearest even
    x_lo = to_output(x - x_hi.to(tl.float32), y.dtype, F32)  # downcast: rounding error of the high part
    return mma_acc(x_lo, y, mma_acc(x_hi, y, acc, F32), F32)


def mma_right_acc_ref(x: torch.Tensor, y: torch.Tensor, acc: torch.Tensor, mode: int) -> torch.Tensor:
    """Twin of `mma_right_acc` in float64: `acc + x @ y` with y as the tensor cores take it (MODE 0:
    `hi + lo` in x's dtype, 2: rounded to it)."""
    y_hi = y.to(x.dtype)
    y_in = y_hi.double() + (y - y_hi.float()).to(x.dtype).double() if mode == 0 else y_hi.double()
    return acc.double() + x.double() @ y_in


UPDATE_DOTS = {"split": 0, "rounded": 2}  # how mma_right_acc runs on bf16/fp16 inputs (KernelConfig.decay_update_dot)
SPLIT = tl.constexpr(UPDATE_DOTS["split"])  # mma_right_acc's MODE where no config chooses
FP32_DOTS = {"split": 0, "rounded": 2}  # how mma_fp32 and mma_halves run on bf16/fp16 inputs (numbered as UPDATE_DOTS)


def fp32_dot_mode(config, field: str, modes: dict = FP32_DOTS) -> int:
    """The mode of `modes` (`FP32_DOTS`, `UPDATE_DOTS`) that the KernelConfig field `field` names;
    ValueError for another name."""
    name = getattr(config, field)
    if name not in modes:
        raise ValueError(f"KernelConfig: expected {field} in {sorted(modes)}, got {name!r}")
    return modes[name]


@triton.jit
def mma_fp32(x, y, dtype: tl.constexpr, F32: tl.constexpr, MODE: tl.constexpr):
    """`x @ y` for two fp32 operands. With F32 (fp32 inputs, the interpreter) one IEEE product;
    else by MODE (`FP32_DOTS`): 0 both split in `dtype` halves, the `lo @ lo` term (~2^-16
    relative) dropped, three products; 2 both rounded to `dtype`, one product (what a kernel without
    the split does)."""
    if F32:
        return tl.dot(x, y, input_precision="ieee")
    x_hi = x.to(dtype)  # downcast: high part
    y_hi = y.to(dtype)  # downcast: high part
    if MODE == 2:
        return tl.dot(x_hi, y_hi)
    x_lo = (x - x_hi.to(tl.float32)).to(dtype)  # downcast: rounding error of the high part
    y_lo = (y - y_hi.to(tl.float32)).to(dtype)  # downcast: rounding error of the high part
    return tl.dot(x_hi, y_hi) + tl.dot(x_lo, y_hi) + tl.dot(x_hi, y_lo)


@triton.jit
def mma_mixed(x, y, dtype: tl.constexpr, F32: tl.constexpr, MODE: tl.constexpr):
    """`x @ y` where each operand holds either fp32 values or `dtype` ones (an output's gradient may come in
    either): a `dtype` operand enters as it is, an fp32 one split, so the product is `mma`, `mma_right_fp32`,
    `mma_left_fp32` or `mma_fp32` (MODE) as the operands are. fp32 inputs (`dtype` fp32): one IEEE product."""
    if x.dtype == dtype:
        if y.dtype == dtype:
            return mma(x, y, F32)
        return mma_right_fp32(x, y, F32)
    if y.dtype == dtype:
        return mma_left_fp32(x, y, F32)
    return mma_fp32(x, y, dtype, F32, MODE)


@triton.jit
def mma_halves(x_hi, x_lo, y, F32: tl.constexpr, MODE: tl.constexpr):
    """`x @ y` for an fp32 `x` stored as its two input-dtype halves (`x_hi` = x rounded, `x_lo` = the
    rounding error rounded: `split_halves`), so a loop that reads it need not split it again, and an fp32 `y`:
    `mma_fp32`'s products (MODE 0: three, 2: `x_hi` with y rounded). An fp32 `x_hi` is x itself (fp32
    inputs: one IEEE product, `x_lo` unread)."""
    if x_hi.dtype == tl.float32:
        return tl.dot(x_hi, y, input_precision="ieee")
    y_hi = y.to(x_hi.dtype)  # downcast: high part
    if MODE == 2:
        return mma(x_hi, y_hi, F32)
    y_lo = (y - y_hi.to(tl.float32)).to(x_hi.dtype)  # downcast: rounding error of the high part
    return mma(x_hi, y_hi, F32) + mma(x_lo, y_hi, F32) + mma(x_hi, y_lo, F32)


@triton.jit
def mma_right_halves(x, y_hi, y_lo, F32: tl.constexpr):
    """`x @ y` for an input-dtype `x` and an fp32 `y` held as its halves (`split_halves`): `mma_right_fp32`'s two
    products, for a `y` that several products read. An fp32 `y_hi` is y itself (fp32 inputs: one IEEE product)."""
    if y_hi.dtype == tl.float32:
        return tl.dot(x, y_hi, input_precision="ieee")
    return mma(x, y_hi, F32) + mma(x, y_lo, F32)


@triton.jit
def split_halves(x, dtype: tl.constexpr, F32: tl.constexpr):
    """fp32 `x` as two `dtype` values, `(hi, lo)`: hi = x rounded to nearest, lo = its rounding error rounded."""
    x_hi = to_output(x, dtype, F32)  # downcast: high part, nearest even
    return x_hi, to_output(x - x_hi.to(tl.float32), dtype, F32)  # downcast: rounding error of the high part


@triton.jit
def first_nonfinite_row(x):
    """The first row index of `x [C, *]` that holds a NaN or an Inf (`x - x` is 0 exactly for finite
    values), C when there is none: the chunk's rows from it on are non-finite input."""
    xf = x.to(tl.float32)  # NaN and Inf stay so; the interpreter holds bf16 as raw bits, where x - x is 0 for them too
    bad = tl.sum(tl.where(xf - xf == 0, 0, 1), axis=1) > 0  # [C]
    o_t = tl.arange(0, x.shape[0])
    return tl.min(tl.where(bad, o_t, x.shape[0]), axis=0)


def first_nonfinite_row_ref(x: torch.Tensor) -> int:
    """Twin of `first_nonfinite_row` for one chunk `x [C, *]`."""
    bad = ~torch.isfinite(x).all(-1)  # [C]
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else x.shape[0]


@triton.jit
def zero_rows_from(x, first):
    """`x [C, *]` with its rows from row `first` on set to zero (in x's dtype): they enter a product as nothing."""
    return tl.where(tl.arange(0, x.shape[0])[:, None] < first, x, 0.0).to(x.dtype)


@triton.jit
def nan_rows_from(x, first):
    """`x [C, *]` with its rows from row `first` on set to NaN: outputs that read a non-finite input."""
    return tl.where(tl.arange(0, x.shape[0])[:, None] < first, x, float("nan"))


@triton.jit
def to_output(x, dtype: tl.constexpr, F32: tl.constexpr):
    """Downcast fp32 `x` to `dtype` (an output, or an operand rounded for the tensor cores), rounding
    to nearest even. The interpreter truncates fp32 -> bf16 (F32 and bf16 only meet there), so there
    the rounding is done on the bits first and the cast is exact."""
    if F32 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
