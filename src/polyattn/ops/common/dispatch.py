"""Implementation dispatch: one vocabulary of forms for every mechanism (ops/README.md, "Forms")."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

FORMS = ("naive", "recurrent", "chunk", "scan", "parallel", "triton", "triton_parallel", "triton_chunk")


def resolve_impl(mechanism: str, impl: str, available: Mapping[str, Callable], q: torch.Tensor) -> Callable:
    """Return the form function named by ``impl`` for inputs like ``q``.

    ``"auto"`` picks ``"triton"`` for fp16/bf16/fp32 CUDA tensors when the mechanism has it (a
    one-token call without gradients runs its fused decoding step there), else ``"recurrent"`` for
    one token (``q: [B, 1, H, K]``) and ``"chunk"`` for more (float64 always takes the PyTorch
    forms: the kernels compute in fp32). A name outside :data:`FORMS` raises ``ValueError``; a known
    form that this mechanism lacks raises ``NotImplementedError`` naming the forms it has.
    """
    if impl == "auto":
        gpu = q.device.type == "cuda" and q.dtype != torch.float64
        one_token = q.dim() == 4 and q.shape[1] == 1
        if gpu and "triton" in available:
            impl = "triton"  # one token: the Triton forms run their fused decoding step
        elif one_token and "recurrent" in available:
            impl = "recurrent"
        else:
            impl = "chunk"
    if impl not in FORMS:
        raise ValueError(f"impl must be 'auto' or one of {list(FORMS)}, got {impl!r}")
    if impl not in available:
        raise NotImplementedError(f"{mechanism} has no impl={impl!r}; it has {sorted(available)} and 'auto'")
    return available[impl]


def one_token_step(q: torch.Tensor, cu_seqlens, tensors) -> bool:
    """A call that the fused decoding step serves: one token per sequence (`T == 1`, no
    `cu_seqlens`) and no gradient wanted from any of `tensors` (the call's tensors and states, a
    state a tensor or a NamedTuple of them; None skipped). The step kernel then replaces the chunk
    kernels: one read and one write of the state instead of a chunk's worth of work on a padded chunk."""
    return q.shape[1] == 1 and cu_seqlens is None and not wants_grad(tensors)


def wants_grad(tensors) -> bool:
    """Whether autograd would record a call on `tensors` (tensors, or NamedTuples of them; None skipped)."""
    flat = (x for t in tensors if t is not None for x in (t if isinstance(t, tuple) else (t,)))
    return torch.is_grad_enabled() and any(x.requires_grad for x in flat)
