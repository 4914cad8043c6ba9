"""Synthetic recall tasks, deterministic by seed: MQAR (Zoology), overwrite, induction heads, UUID NIAH;
and ``text``, language modelling on real text (`polyattn.tasks.text`).

`TASKS` maps a task name to its generator `fn(num_examples, seq_len, num_pairs, *, seed, **options)
-> TaskData`; `make_task(name, ...)` raises a clear ValueError for unknown names. Each generator's module
docstring shows the token layout on a worked example.
"""

from polyattn.tasks.common import IGNORE_INDEX, Segment, TaskData, concat_data
from polyattn.tasks.induction import induction
from polyattn.tasks.mqar import ZOOLOGY_TEST, ZOOLOGY_TRAIN, mqar
from polyattn.tasks.niah import niah_uuid
from polyattn.tasks.overwrite import overwrite
from polyattn.tasks.text import text

TASKS = {"mqar": mqar, "overwrite": overwrite, "induction": induction, "niah": niah_uuid, "text": text}


def make_task(name, num_examples, seq_len, num_pairs, *, seed=0, **options):
    """Build `num_examples` examples of task `name` (one of `TASKS`)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: expected one of {sorted(TASKS)}")
    return TASKS[name](num_examples, seq_len, num_pairs, seed=seed, **options)


__all__ = [
    "IGNORE_INDEX",
    "TASKS",
    "ZOOLOGY_TEST",
    "ZOOLOGY_TRAIN",
    "Segment",
    "TaskData",
    "concat_data",
    "induction",
    "make_task",
    "mqar",
    "niah_uuid",
    "overwrite",
    "text",
]
