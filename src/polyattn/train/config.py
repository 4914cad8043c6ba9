"""Training configuration (one dataclass, JSON round-trippable)."""

from dataclasses import dataclass, field

from polyattn.tasks import TASKS, Segment


def as_segment(s):
    """A `Segment` from a Segment, a ``(seq_len, num_examples, num_pairs)`` triple or its JSON dict."""
    if isinstance(s, Segment):
        return s
    return Segment(**s) if isinstance(s, dict) else Segment(*s)


@dataclass
class TrainConfig:
    """One training run: task and its train/test segments, model, optimiser, schedule, output.

    Segments are ``(seq_len, num_examples, num_pairs)`` triples. Test segments longer than every train
    segment are the extrapolation slices. ``steps`` optimiser steps of ``batch_size`` sequences, each
    batch drawn from one train length (proportionally to its examples). LR: linear warmup over
    ``warmup`` of the steps, then cosine to 0 (AdamW, weight decay off for norms, biases and gates).
    ``early_stop``: stop once the mean train-batch accuracy of the last 20 steps reaches it (batches are
    fresh samples, so this tracks held-out accuracy at no extra cost).
    """

    task: str = "mqar"
    task_options: dict = field(default_factory=lambda: {"vocab_size": 8192})
    train_segments: list = field(default_factory=lambda: [(64, 20_000, 4), (128, 20_000, 8), (256, 20_000, 16)])
    test_segments: list = field(default_factory=lambda: [(64, 500, 4), (256, 500, 16), (1024, 500, 64)])
    mixer: str = "kata-m2"
    mixer_config: dict = field(default_factory=dict)
    d_model: int = 64
    n_layers: int = 2
    mlp_ratio: float = 0.0
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup: float = 0.1
    steps: int = 1000
    batch_size: int = 64
    eval_batch_size: int = 64
    grad_clip: float = 1.0
    seed: int = 123
    device: str = "auto"
    impl: str = "auto"
    bf16: bool = True
    early_stop: float | None = None
    out_dir: str | None = None
    checkpoint: bool = True

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}: expected one of {sorted(TASKS)}")
        self.train_segments = [as_segment(s) for s in self.train_segments]
        self.test_segments = [as_segment(s) for s in self.test_segments]
        if not self.train_segments or not self.test_segments:
            raise ValueError("expected at least one train and one test segment")
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0 or not 0 <= self.warmup < 1:
            raise ValueError(
                f"expected steps >= 1, batch_size >= 1, lr > 0, 0 <= warmup < 1, got "
                f"{self.steps}, {self.batch_size}, {self.lr}, {self.warmup}"
            )

    @property
    def max_train_len(self):
        return max(s.seq_len for s in self.train_segments)
