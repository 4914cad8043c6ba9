"""The shared Triton kernel core: the pieces every family's kernels are built from.

Nothing here names a family. `precision` holds the one `LOG2E`, the dot helpers that keep fp32
operands exact enough on bf16/fp16 tensor cores, and the output downcast; `plan` the launch
configuration, the segment and chunk tables of packed sequences and the per-sequence reverse
cumsum; `decay` the chunk-local log2-decay stages; `causal` the in-chunk score selection and the
score-value product that stay causal under non-finite inputs. Each `@triton.jit` stage has a PyTorch
reference twin (`*_ref`) that `tests/ops/triton/` compares it against. Importing this package
imports triton: the families import it lazily, on the first Triton call.
"""
