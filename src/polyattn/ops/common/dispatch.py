"""Implementation dispatch: one vocabulary of forms for every mechanism (ops/README.md, "Forms")."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from polyattn.ops.common.validate import check_value

FORMS = ("naive", "recurrent", "chunk", "scan", "parallel", "triton")
FINITE_DECAY_FORMS = ("triton",)  # forms not yet exact for g = -inf: they refuse it rather than return NaN


def resolve_impl(
    mechanism: str, impl: str, available: Mapping[str, Callable], q: torch.Tensor, g: torch.Tensor | None = None
) -> Callable:
    """Return the form function named by ``impl`` for inputs like ``q``.

    ``"auto"`` picks ``"triton"`` for fp16/bf16/fp32 CUDA tensors when the mechanism has it (a
    one-token call without gradients runs its fused decoding step there), else ``"recurrent"`` for
    one token (``q: [B, 1, H, K]``) and ``"chunk"`` for more (float64 always takes the PyTorch
    forms: the kernels compute in fp32). A name outside
    :data:`FORMS` raises ``ValueError``; a known form that this mechanism lacks raises
    ``NotImplementedError`` naming the forms it has. A form of :data:`FINITE_DECAY_FORMS` checks that the
    log-decay ``g`` has no ``-inf`` (the exact reset the PyTorch forms guarantee).
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
    if impl in FINITE_DECAY_FORMS and g is not None:
        check_value(g > float("-inf"), f"g: {mechanism} impl={impl!r} takes finite log-decays only (no -inf reset yet); use impl='chunk'")
    return available[impl]
