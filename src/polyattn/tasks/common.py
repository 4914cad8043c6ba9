"""Shared pieces of the synthetic recall tasks: the data container, seeded sampling, segments.

Every task returns a `TaskData`: `inputs` and `labels`, both int64 `[N, T]`, where `labels[n, t]` is
the token the model must predict *after reading* `inputs[n, : t + 1]` (labels are already shifted), and
`IGNORE_INDEX` (-100) everywhere no prediction is scored. Accuracy is measured on scored positions only.
"""

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class TaskData:
    """One evaluation slice: `N` examples of length `length` with `pairs` bindings each."""

    inputs: torch.Tensor  # [N, T] int64
    labels: torch.Tensor  # [N, T] int64, IGNORE_INDEX where unscored
    length: int
    pairs: int

    def __len__(self):
        return self.inputs.shape[0]

    @property
    def name(self):
        return f"T{self.length}-P{self.pairs}"


@dataclass(frozen=True)
class Segment:
    """A (seq_len, num_examples, num_pairs) block of a train or test protocol."""

    seq_len: int
    num_examples: int
    num_pairs: int


def generator(seed):
    return torch.Generator().manual_seed(int(seed))


def sample_distinct(num_rows, num_choices, size, gen, log_weights=None):
    """`size` distinct indices in [0, num_choices) per row, optionally weighted (Gumbel top-k).

    With `log_weights` ([num_choices]) this is sampling without replacement proportional to
    exp(log_weights), the same law as numpy's `choice(replace=False, p=...)`. Uniform draws take the
    rejection sampler when few rows are redrawn: a row of `size` draws has no repeat with probability
    about exp(-size² / 2·num_choices), so past size² = 8·num_choices (under 2 % accepted, e.g. 256 keys of
    4095) they take the Gumbel path.
    """
    if size > num_choices:
        raise ValueError(f"expected at most {num_choices} distinct draws, got size={size}")
    if log_weights is None and 8 * size <= num_choices and size * size <= 8 * num_choices:
        return sample_distinct_sparse(num_rows, num_choices, size, gen)
    u = torch.rand(num_rows, num_choices, generator=gen, dtype=torch.float64)  # [N, C]
    scores = -torch.log(-torch.log(u.clamp_min(1e-300)))  # Gumbel noise, [N, C]
    if log_weights is not None:
        scores = scores + log_weights  # [N, C]
    return scores.topk(size, dim=1).indices  # [N, C] -> [N, size]


def sample_distinct_sparse(num_rows, num_choices, size, gen):
    """Uniform distinct draws when size << num_choices: draw with replacement, redraw rows with repeats.

    Each row is accepted only when all its draws differ, so accepted rows are uniform over ordered
    distinct tuples; cost O(rows · size) instead of O(rows · num_choices).
    """
    out = torch.randint(num_choices, (num_rows, size), generator=gen)  # [N, size]
    redo = torch.arange(num_rows)
    while redo.numel():
        sorted_draws = out[redo].sort(dim=1).values  # [R, size]
        repeats = (sorted_draws[:, 1:] == sorted_draws[:, :-1]).any(dim=1)  # [R]
        redo = redo[repeats]
        out[redo] = torch.randint(num_choices, (redo.numel(), size), generator=gen)  # [R', size]
    return out


def power_law_log_weights(space, power_a):
    """Zoology's query-gap law: P(gap = i) ∝ i^(a-1) for i = 1..space (index i - 1)."""
    i = torch.arange(1, space + 1, dtype=torch.float64)  # [space]
    return (power_a - 1.0) * torch.log(i)  # [space]


def concat_data(parts):
    """Stack same-length `TaskData` parts (e.g. the train mixture at one length) into one."""
    return TaskData(
        inputs=torch.cat([p.inputs for p in parts]),
        labels=torch.cat([p.labels for p in parts]),
        length=parts[0].length,
        pairs=max(p.pairs for p in parts),
    )
