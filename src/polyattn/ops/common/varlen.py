"""Variable-length (packed) sequences for the PyTorch forms, vectorised where the mechanism allows.

- Exact reset (every decayed family: linear attention, the delta rule, HLA, KATA, DeltaKATA): without
  an initial or a final state, the packed sequences run as ONE sequence with ``g = -inf`` on every
  sequence's first token — the weight across it is exactly 0 — at the cost of the unpacked tokens.
- Neutral padding (a token with zero q, k, v, β and g = 0 changes neither earlier outputs nor the
  state: linear attention, the delta rule, HLA): with states, the sequences run as one right-padded
  batch per length class ``(2^(b-1), 2^b]`` — padding at most doubles the tokens and the number of
  calls is log2 of the longest length, however many sequences there are.
- Otherwise sequence by sequence: log-linear (levels follow absolute positions) and KATA with states
  (a batch of P×V states, P up to K², runs slower than the loop).

States are a tensor or a ``NamedTuple`` of tensors, each with a leading sequence dimension N.
Triton forms handle ``cu_seqlens`` natively and use none of these.
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


def state_take(state: State | None, index: torch.Tensor) -> State | None:
    """The sequences ``index`` (an int64 tensor) of a batched state, in that order."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state[index.to(state.device)]
    return type(state)(*(field[index.to(field.device)] for field in state))


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
    *,
    decay_index: int | None = None,
    neutral_padding: bool = False,
    **kwargs,
):
    """Call ``fn(*tensors, initial_state=, output_final_state=, **kwargs)`` on packed sequences.

    ``tensors`` are per-token ``[1, T, ...]`` (or None); outputs come back packed ``[1, T, ...]`` and final
    states stacked along dimension 0 (``[N, ...]``). With ``cu_seqlens=None``, ``fn`` is called once.
    ``decay_index``: the position of the log-decay ``g`` in ``tensors`` when ``g = -inf`` is an exact reset
    for ``fn`` (stateless calls then run as one sequence, :func:`run_with_resets`); ``neutral_padding``:
    zero tokens are neutral for ``fn`` (calls with states run as padded batches,
    :func:`run_padded_batches`); else the sequences run one by one. A form that packs sequences itself
    (a Triton launcher) sets the attribute ``native_varlen = True`` and is called once with ``cu_seqlens=``.
    """
    if getattr(fn, "native_varlen", False):
        return fn(*tensors, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens, **kwargs)
    if cu_seqlens is None:
        return fn(*tensors, initial_state=initial_state, output_final_state=output_final_state, **kwargs)
    if decay_index is not None and initial_state is None and not output_final_state:
        return run_with_resets(fn, tensors, cu_seqlens, decay_index, **kwargs)
    bounds = cu_seqlens.tolist()  # the host needs the layout to cut or pad the batch
    if neutral_padding:
        return run_padded_batches(fn, tensors, bounds, initial_state, output_final_state, **kwargs)
    outputs, finals = [], []
    for i, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        pieces = [None if x is None else x[:, bos:eos] for x in tensors]
        o, final = fn(*pieces, initial_state=state_index(initial_state, i), output_final_state=output_final_state, **kwargs)
        outputs.append(o)
        finals.append(final)
    o = torch.cat(outputs, dim=1)  # N x [1, T_i, H, V] -> [1, T, H, V]
    return o, (state_cat(finals) if output_final_state else None)


def run_with_resets(fn, tensors, cu_seqlens: torch.Tensor, decay_index: int, **kwargs):
    """Packed sequences (zero initial states, no final state) as one sequence whose log-decay is ``-inf``
    on every sequence's first token: an exact reset, nothing crosses a boundary. The offsets stay on the
    device (no host read).

    A non-finite input, which poisons its own sequence from there on, here also poisons the sequences
    packed after it (a reset multiplies the state by 0, and 0 · nan = nan).
    """
    ref = tensors[0]
    g = tensors[decay_index]
    if g is None:
        g = ref.new_zeros(ref.shape[:3])  # [1, T, H]
    pieces = list(tensors)
    pieces[decay_index] = g.index_fill(1, cu_seqlens[:-1].long(), float("-inf"))  # [1, T, H]: a reset at every first token
    o, _ = fn(*pieces, initial_state=None, output_final_state=False, **kwargs)
    return o, None


def run_padded_batches(fn, tensors, bounds: list[int], initial_state, output_final_state: bool, **kwargs):
    """Packed sequences (offsets ``bounds``) as one right-padded batch per length class ``(2^(b-1), 2^b]``.

    Exact when a padding token (zeros everywhere, g = 0) is neutral: it comes after every real token
    of its row, so it changes no output, and it leaves the state as it was, so the row's final state
    is the sequence's.
    """
    ref = next(x for x in tensors if x is not None)
    T, device = ref.shape[1], ref.device
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    classes: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        classes.setdefault((n - 1).bit_length(), []).append(i)
    padded = [None if x is None else torch.cat([x[0], x.new_zeros(1, *x.shape[2:])]) for x in tensors]  # [T + 1, ...], row T = 0
    starts = torch.tensor(bounds[:-1], device=device)  # [N]
    sizes = torch.tensor(lengths, device=device)  # [N]
    outputs, places, finals, order = [], [], [], []
    for members in classes.values():
        seqs = torch.tensor(members, device=device)  # [n]
        width = max(lengths[i] for i in members)
        offsets = torch.arange(width, device=device)  # [width]
        real = offsets[None, :] < sizes[seqs][:, None]  # [n, width]
        index = torch.where(real, starts[seqs][:, None] + offsets[None, :], T)  # [n, width]: token, or the zero row
        pieces = [None if x is None else x[index] for x in padded]  # [T + 1, ...] -> [n, width, ...]
        o, final = fn(*pieces, initial_state=state_take(initial_state, seqs), output_final_state=output_final_state, **kwargs)
        outputs.append(o[real])  # [n, width, H, V] -> [tokens of the class, H, V]
        places.append(index[real])
        finals.append(final)
        order.append(seqs)
    o = torch.cat(outputs)[torch.argsort(torch.cat(places))]  # back to packed order: [T, H, V]
    if not output_final_state:
        return o[None], None
    return o[None], state_take(state_cat(finals), torch.argsort(torch.cat(order)))  # [1, T, H, V], [N, ...]
