"""Variable-length (packed) sequences for the PyTorch forms: run each sequence, concatenate.

States are a tensor or a ``NamedTuple`` of tensors, each with a leading sequence dimension N.
Triton forms handle ``cu_seqlens`` natively and do not use this loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

State = torch.Tensor | tuple


def state_index(state: State | None, i: int) -> State | None:
    """Sequence ``i`` of a batched state, keeping a leading dimension of 1."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state[i : i + 1]
    return type(state)(*(field[i : i + 1] for field in state))


def state_cat(states: Sequence[State]) -> State:
    """Concatenate per-sequence states (each with leading dimension 1 or more) along dimension 0."""
    first = states[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(states), dim=0)
    return type(first)(*(torch.cat(list(fields), dim=0) for fields in zip(*states)))


def run_varlen(
    fn: Callable,
    tensors: Sequence[torch.Tensor | None],
    cu_seqlens: torch.Tensor | None,
    initial_state: State | None,
    output_final_state: bool,
    **kwargs,
):
    """Call ``fn(*tensors, initial_state=, output_final_state=, **kwargs)`` once per packed sequence.

    ``tensors`` are per-token ``[1, T, ...]`` (or None); outputs are concatenated along time and final
    states stacked along dimension 0 (``[N, ...]``). With ``cu_seqlens=None``, ``fn`` is called once. A form
    that packs sequences itself (a Triton launcher) sets the attribute ``native_varlen = True`` and is
    called once with ``cu_seqlens=``.
    """
    if getattr(fn, "native_varlen", False):
        return fn(*tensors, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens, **kwargs)
    if cu_seqlens is None:
        return fn(*tensors, initial_state=initial_state, output_final_state=output_final_state, **kwargs)
    bounds = cu_seqlens.tolist()
    outputs, finals = [], []
    for i, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        pieces = [None if x is None else x[:, bos:eos] for x in tensors]
        o, final = fn(*pieces, initial_state=state_index(initial_state, i), output_final_state=output_final_state, **kwargs)
        outputs.append(o)
        finals.append(final)
    o = torch.cat(outputs, dim=1)  # N x [1, T_i, H, V] -> [1, T, H, V]
    return o, (state_cat(finals) if output_final_state else None)
