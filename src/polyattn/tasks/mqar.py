"""Multi-query associative recall (MQAR), the Zoology protocol (Arora et al., 2023).

Generator semantics follow `zoology.data.associative_recall.multiquery_ar`:

* the vocabulary is split in halves: keys come from ``[1, vocab/2)`` and values from ``[vocab/2, vocab)``;
  token 0 is the filler;
* every key is unique within an example, and so is every value;
* the key-value block ``k1 v1 k2 v2 ...`` sits at the start; the remaining ``T - 2P`` positions hold the
  queries, one per key (in random order), placed at even offsets ``2·gap`` where the gaps are drawn without
  replacement from the power law ``P(gap = i) ∝ i^(a-1)``, ``i = 1..(T-2P)/2`` (a = 0.01: mostly short);
* labels are -100 except at query positions, where they equal the value bound to the queried key;
* with ``random_non_queries=True`` the filler positions get random tokens from the whole vocabulary.

Worked example (``vocab_size=16``: keys 1..7, values 8..15; ``seq_len=12, num_pairs=2``,
``random_non_queries=False``)::

    position  0  1  2  3  4  5  6  7  8  9 10 11
    inputs    3 12  5  9  5  0  0  0  3  0  0  0      kv block "3→12, 5→9", queries 5 (gap 0), 3 (gap 2)
    labels    .  .  .  .  9  .  .  .  12 .  .  .      "." = -100: scored only where a key is queried
"""

import torch

from polyattn.tasks.common import (
    IGNORE_INDEX,
    Segment,
    TaskData,
    generator,
    power_law_log_weights,
    sample_distinct,
)

# Zoology's "original MQAR" train mixture and test grid (the Based paper's protocol), scaled by `num_examples`.
ZOOLOGY_TRAIN = (
    Segment(64, 100_000, 4),
    Segment(128, 20_000, 8),
    Segment(256, 20_000, 16),
    Segment(256, 20_000, 32),
    Segment(256, 20_000, 64),
)
ZOOLOGY_TEST = (
    Segment(64, 1000, 4),
    Segment(64, 1000, 8),
    Segment(64, 1000, 16),
    Segment(128, 1000, 32),
    Segment(256, 1000, 64),
    Segment(512, 1000, 128),
    Segment(1024, 1000, 256),
)


def check_mqar_shape(seq_len, num_pairs, vocab_size, writes):
    """Raise ValueError unless `writes` bindings + `num_pairs` queries fit in `seq_len` and the vocab."""
    if num_pairs < 1:
        raise ValueError(f"expected num_pairs >= 1, got {num_pairs}")
    if seq_len % 2:
        raise ValueError(f"expected an even seq_len, got {seq_len}")
    if (seq_len - 2 * writes) // 2 < num_pairs:
        raise ValueError(
            f"expected seq_len >= 2 * (bindings + queries) = {2 * (writes + num_pairs)}, got {seq_len}"
        )
    if num_pairs > vocab_size // 2 - 1 or writes > vocab_size - vocab_size // 2:
        raise ValueError(
            f"expected vocab_size large enough for {num_pairs} keys and {writes} values, got {vocab_size}"
        )


def place_queries(num_examples, seq_len, context, query_keys, answers, power_a, gen):
    """Put `query_keys` ([N, P]) after a `context`-long prefix at power-law gaps; return inputs, labels."""
    P = query_keys.shape[1]
    space = (seq_len - context) // 2
    gaps = sample_distinct(num_examples, space, P, gen, power_law_log_weights(space, power_a))  # [N, P]
    pos = context + 2 * gaps  # [N, P] absolute query positions
    inputs = torch.zeros(num_examples, seq_len, dtype=torch.long)  # [N, T]
    labels = torch.full((num_examples, seq_len), IGNORE_INDEX, dtype=torch.long)  # [N, T]
    inputs.scatter_(1, pos, query_keys)
    labels.scatter_(1, pos, answers)
    return inputs, labels


def fill_random(inputs, labels, context, vocab_size, gen):
    """Replace filler zeros after the context block by random tokens (never at query positions)."""
    filler = inputs == 0  # [N, T]
    filler[:, :context] = False
    filler &= labels == IGNORE_INDEX
    noise = torch.randint(vocab_size, inputs.shape, generator=gen)  # [N, T]
    return torch.where(filler, noise, inputs)


def mqar(num_examples, seq_len, num_pairs, *, vocab_size=8192, power_a=0.01, random_non_queries=True, seed=0):
    """MQAR examples (see the module docstring for the layout and a worked example)."""
    check_mqar_shape(seq_len, num_pairs, vocab_size, num_pairs)
    gen = generator(seed)
    half = vocab_size // 2
    keys = 1 + sample_distinct(num_examples, half - 1, num_pairs, gen)  # [N, P] in [1, half)
    values = half + sample_distinct(num_examples, vocab_size - half, num_pairs, gen)  # [N, P] in [half, V)
    context = 2 * num_pairs
    order = sample_distinct(num_examples, num_pairs, num_pairs, gen)  # [N, P] query order (a permutation)
    inputs, labels = place_queries(
        num_examples, seq_len, context, keys.gather(1, order), values.gather(1, order), power_a, gen
    )
    inputs[:, 0:context:2] = keys
    inputs[:, 1:context:2] = values
    if random_non_queries:
        inputs = fill_random(inputs, labels, context, vocab_size, gen)
    return TaskData(inputs, labels, seq_len, num_pairs)
