"""Needle in a haystack with UUID-like needles (RULER "S-NIAH-3" style, as tokens).

Vocabulary layout (``vocab_size >= 3 + 16 + num_pairs + 8``): 0 = NEEDLE marker, 1 = QUERY marker,
2 = ANSWER marker, 3..18 = the 16 hex digits of the UUIDs, 19..19+K = needle names, the rest = haystack
words. An example is a haystack of random words with ``num_pairs`` needles ``NEEDLE name u1 .. uD``
(distinct names, independent uniform hex digits: 4·D bits of entropy each) at random non-overlapping
places, then ``QUERY name ANSWER u1 .. uD`` for one of them at the very end. The labels ask for the
digits: after ``ANSWER`` predict u1, after u1 predict u2, ... (teacher forcing, D scored positions).

Worked example (``uuid_len=2``, names 19, 20; words >= 21; ``seq_len=20, num_pairs=2``)::

    position  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19
    inputs    0 19  7 12 27 30 22 25  0 20  4  3 31 28 21  1 20  2  4  3   needles 19→7,12 and 20→4,3
    labels    .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  4  3  .   query 20: digits 4, 3

Needles start at multiples of ``2 + uuid_len`` (non-overlapping slots); the query tail is the last
``3 + uuid_len`` tokens.
"""

import torch

from polyattn.tasks.common import IGNORE_INDEX, TaskData, generator, sample_distinct

NEEDLE, QUERY, ANSWER = 0, 1, 2
HEX_START, HEX_DIGITS = 3, 16
NAME_START = HEX_START + HEX_DIGITS


def niah_uuid(num_examples, seq_len, num_pairs=1, *, uuid_len=8, num_names=64, vocab_size=256, seed=0):
    """UUID needle-in-a-haystack examples (see the module docstring for the layout and an example)."""
    words_start = NAME_START + num_names
    needle_len = 2 + uuid_len
    tail = 3 + uuid_len
    if num_pairs > num_names or vocab_size <= words_start:
        raise ValueError(
            f"expected num_pairs <= num_names ({num_names}) and vocab_size > {words_start}, "
            f"got {num_pairs} and {vocab_size}"
        )
    slots = (seq_len - tail) // needle_len
    if slots < num_pairs:
        raise ValueError(f"expected seq_len >= {num_pairs * needle_len + tail}, got {seq_len}")
    gen = generator(seed)
    N, T = num_examples, seq_len
    inputs = torch.randint(words_start, vocab_size, (N, T), generator=gen)  # [N, T] haystack
    names = NAME_START + sample_distinct(N, num_names, num_pairs, gen)  # [N, P]
    digits = HEX_START + torch.randint(HEX_DIGITS, (N, num_pairs, uuid_len), generator=gen)  # [N, P, D]
    slot = sample_distinct(N, slots, num_pairs, gen)  # [N, P] needle slots, non-overlapping
    needles = torch.cat([torch.full_like(names, NEEDLE)[..., None], names[..., None], digits], dim=2)  # [N, P, 2+D]
    pos = slot[..., None] * needle_len + torch.arange(needle_len)  # [N, P, 2+D]
    inputs.scatter_(1, pos.flatten(1), needles.flatten(1))
    asked = torch.randint(num_pairs, (N, 1), generator=gen)  # [N, 1]
    answer = digits.gather(1, asked[..., None].expand(-1, -1, uuid_len))[:, 0]  # [N, D]
    inputs[:, T - tail] = QUERY
    inputs[:, T - tail + 1] = names.gather(1, asked)[:, 0]
    inputs[:, T - tail + 2] = ANSWER
    inputs[:, T - uuid_len :] = answer
    labels = torch.full_like(inputs, IGNORE_INDEX)  # [N, T]
    labels[:, T - uuid_len - 1 : T - 1] = answer
    return TaskData(inputs, labels, seq_len, num_pairs)
