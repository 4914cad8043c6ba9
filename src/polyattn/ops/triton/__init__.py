"""The shared Triton kernel core: the pieces every family's kernels are built from.

Nothing here names a family. `precision` holds the one `LOG2E`, the dot helpers that keep fp32
operands exact enough on bf16/fp16 tensor cores, the output downcast and the row helpers that keep
outputs causal under non-finite inputs (the first non-finite row, rows zeroed or made NaN from it);
`plan` the launch configuration, the segment and chunk tables of packed sequences and the per-sequence
reverse cumsum; `decay` the chunk-local log2-decay stages; `step` the shared front of the decoding
steps; `launches` the kernel launches recorded under the interpreter and built for Hopper without a GPU
(the CPU tests' compile check). Each `@triton.jit` stage has a PyTorch reference twin (`*_ref`) that
`tests/ops/triton/` compares it against. Importing `decay`, `plan`, `precision` or `step` imports
triton: the families import them lazily, on the first Triton call.
"""
