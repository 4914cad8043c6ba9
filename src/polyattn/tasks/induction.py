"""Induction heads: after a trigger token reappears, predict the token that followed it the first time.

Layout: random tokens from ``[1, vocab)``; token 0 is the trigger and appears exactly twice. Its first
occurrence sits at a uniform position in the first ``T - 2`` slots and is followed by the target; the
second occurrence is the last token, scored with the target as label. ``num_pairs`` must be 1 (one
binding per example); the slice still reports it so tables line up with the other tasks.

Worked example (``vocab_size=10, seq_len=8``)::

    position  0  1  2  3  4  5  6  7
    inputs    4  9  0  7  2  5  3  0      trigger 0 at 2 is followed by 7
    labels    .  .  .  .  .  .  .  7      scored only at the final trigger
"""

import torch

from polyattn.tasks.common import IGNORE_INDEX, TaskData, generator

TRIGGER = 0


def induction(num_examples, seq_len, num_pairs=1, *, vocab_size=64, seed=0):
    """Induction-head examples (see the module docstring for the layout and a worked example)."""
    if num_pairs != 1:
        raise ValueError(f"expected num_pairs == 1 for induction, got {num_pairs}")
    if seq_len < 4 or vocab_size < 3:
        raise ValueError(f"expected seq_len >= 4 and vocab_size >= 3, got {seq_len} and {vocab_size}")
    gen = generator(seed)
    inputs = torch.randint(1, vocab_size, (num_examples, seq_len), generator=gen)  # [N, T]
    first = torch.randint(seq_len - 2, (num_examples, 1), generator=gen)  # [N, 1]
    inputs.scatter_(1, first, TRIGGER)
    inputs[:, -1] = TRIGGER
    labels = torch.full_like(inputs, IGNORE_INDEX)  # [N, T]
    labels[:, -1] = inputs.gather(1, first + 1)[:, 0]
    return TaskData(inputs, labels, seq_len, 1)
