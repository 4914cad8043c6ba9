"""Repeated-key overwrite: MQAR where some keys are re-bound and queries want the *latest* value.

Close to Zoology's `forgetting_mqar`, the likely source of the KATA paper's repeated-key overwrite task. Layout:

* ``num_pairs`` distinct keys from ``[1, vocab/2)``; the write stream has ``num_pairs + num_updates``
  bindings ``k v``: every key once, plus ``num_updates`` extra writes of keys drawn (with replacement) from
  the same set, the whole stream shuffled; every write carries a fresh value from ``[vocab/2, vocab)``
  (values are distinct within an example, so a rewrite always changes the binding);
* after the write stream, every key is queried once at power-law gaps, exactly as in MQAR;
* the label at a query is the value of that key's **last** write.

Worked example (``vocab_size=16``, ``seq_len=16, num_pairs=2, num_updates=1``, no random filler)::

    position  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    inputs    5  8  3 12  5 10  3  0  5  0  0  0  0  0  0  0    writes 5→8, 3→12, 5→10; queries 3, 5
    labels    .  .  .  .  .  .  12 .  10 .  .  .  .  .  .  .    key 5 answers 10 (its latest value), not 8
"""

import torch

from polyattn.tasks.common import TaskData, generator, sample_distinct
from polyattn.tasks.mqar import check_mqar_shape, fill_random, place_queries


def overwrite(
    num_examples,
    seq_len,
    num_pairs,
    *,
    num_updates=4,
    vocab_size=8192,
    power_a=0.01,
    random_non_queries=True,
    seed=0,
):
    """Overwrite examples (see the module docstring for the layout and a worked example)."""
    writes = num_pairs + num_updates
    check_mqar_shape(seq_len, num_pairs, vocab_size, writes)
    gen = generator(seed)
    half = vocab_size // 2
    keys = 1 + sample_distinct(num_examples, half - 1, num_pairs, gen)  # [N, P]
    extra = torch.randint(num_pairs, (num_examples, num_updates), generator=gen)  # [N, U] key slots
    slots = torch.cat([torch.arange(num_pairs).expand(num_examples, -1), extra], dim=1)  # [N, W]
    shuffle = sample_distinct(num_examples, writes, writes, gen)  # [N, W] a random permutation
    slots = slots.gather(1, shuffle)  # [N, W] key slot of each write, in stream order
    values = half + sample_distinct(num_examples, vocab_size - half, writes, gen)  # [N, W]
    is_slot = slots[:, :, None] == torch.arange(num_pairs)  # [N, W, P]
    step = torch.arange(writes)[None, :, None]  # [1, W, 1]
    last_write = torch.where(is_slot, step, -1).amax(dim=1)  # [N, W, P] -> [N, P]
    latest = values.gather(1, last_write)  # [N, P] latest value of each key
    order = sample_distinct(num_examples, num_pairs, num_pairs, gen)  # [N, P] query order
    context = 2 * writes
    inputs, labels = place_queries(
        num_examples, seq_len, context, keys.gather(1, order), latest.gather(1, order), power_a, gen
    )
    inputs[:, 0:context:2] = keys.gather(1, slots)
    inputs[:, 1:context:2] = values
    if random_non_queries:
        inputs = fill_random(inputs, labels, context, vocab_size, gen)
    return TaskData(inputs, labels, seq_len, num_pairs)
