"""Training configuration (one dataclass, JSON round-trippable)."""

import re
from dataclasses import dataclass, field

import torch

from polyattn.layers import MIXERS
from polyattn.tasks import TASKS, Segment
from polyattn.train.distributed import PARALLEL

DEFAULT_MIXER = "kata-m2"
HYBRID_NAME = re.compile(r"[A-Za-z0-9._+-]+")  # it names files (a sweep's cells/)


def as_segment(s):
    """A `Segment` from a Segment, a ``(seq_len, num_examples, num_pairs)`` triple or its JSON dict."""
    if not isinstance(s, Segment):
        try:
            s = Segment(**s) if isinstance(s, dict) else Segment(*s)
        except TypeError as err:
            raise ValueError(f"segment: expected (seq_len, num_examples, num_pairs), got {s!r}") from err
    for name, low in (("seq_len", 1), ("num_examples", 1), ("num_pairs", 0)):  # 0 pairs: tasks without pairs (text)
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"segment: expected {name} an integer >= {low}, got {value!r} in {s}")
    return s


def layer_name(entry):
    """The mixer name of a ``layer_mixers`` entry: a name, or a dict ``{"name": NAME, **options}``."""
    return entry if isinstance(entry, str) else entry["name"]


def check_layer_mixers(layer_mixers, n_layers):
    """ValueError unless `layer_mixers` is a list of `n_layers` entries, each a registered mixer's name or a dict
    ``{"name": NAME, **options}`` (the options are checked when the model is built)."""
    if not isinstance(layer_mixers, list):
        raise ValueError(f"layer_mixers: expected a list of mixers, one per layer, got {layer_mixers!r}")
    if len(layer_mixers) != n_layers:
        raise ValueError(f"layer_mixers: expected {n_layers} entries (one per layer, n_layers={n_layers}), got {len(layer_mixers)}")
    for i, entry in enumerate(layer_mixers):
        if not isinstance(entry, str) and not (isinstance(entry, dict) and isinstance(entry.get("name"), str)):
            raise ValueError(f"layer_mixers[{i}]: expected a mixer name or an object {{\"name\": NAME, **options}}, got {entry!r}")
        if layer_name(entry) not in MIXERS:
            raise ValueError(f"layer_mixers[{i}]: unknown mixer {layer_name(entry)!r}: expected one of {list(MIXERS)}")


def check_hybrid_name(where, name):
    """A hybrid's name: letters, digits and ``. _ + -``, not a registered mixer's name."""
    if not isinstance(name, str) or not HYBRID_NAME.fullmatch(name) or name in MIXERS:
        raise ValueError(f"{where}: expected letters, digits and . _ + - other than a registered mixer's name, got {name!r}")


def _check_number(name, value, low, high=float("inf"), *, integer=False, low_open=False, high_open=False):
    """``low <= value <= high`` (or open ends), a real number (an int when ``integer``), never a bool."""
    kinds = (int,) if integer else (int, float)
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if isinstance(value, bool) or not isinstance(value, kinds) or value != value or below or above:
        lo, hi = ("(" if low_open else "[") + f"{low:g}", f"{high:g}" + (")" if high_open else "]")
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name}: expected {kind} in {lo}, {hi}, got {value!r}")


@dataclass
class TrainConfig:
    """One training run: task and its train/test segments, model, optimiser, schedule, output.

    Segments are ``(seq_len, num_examples, num_pairs)`` triples. Test segments longer than every train
    segment are the extrapolation slices. ``steps`` optimiser steps of ``batch_size`` sequences, each
    batch drawn from one train length (proportionally to its examples). LR: linear warmup over
    ``warmup`` of the steps, then cosine to 0 (AdamW, weight decay off for norms, biases and gates).
    ``early_stop``: stop once the mean train-batch accuracy of the last 20 steps reaches it (batches are
    fresh samples, so this tracks held-out accuracy at no extra cost).

    ``mixer`` (None: ``"kata-m2"``) with ``mixer_config`` builds every layer. ``layer_mixers``: a hybrid, one
    entry per layer as `LMConfig.layer_mixers` takes them (a mixer name or ``{"name": NAME, **options}``); each
    layer gets exactly its entry's options (and ``impl`` unless the entry names one), so ``mixer_config`` must
    be empty, and ``mixer`` is the hybrid's name in results and sweeps (None: the layers' names joined by
    ``+``; not a registered mixer's name).

    ``parallel``: ``"none"`` (one process), ``"ddp"`` or ``"fsdp"`` (one rank of a ``torchrun`` launch; each rank
    trains on ``batch_size / world_size`` rows of the same global batch), ``"cp"`` (context parallelism: each
    rank trains on every row's contiguous ``1 / world_size`` of the positions, the mixers exchanging shard summaries). ``compile``: a ``torch.compile``
    backend applied to every block (``"inductor"``), or None. ``save_every``: write the sharded training state
    (model, optimizer, schedule, data order) to ``out_dir/train_state/step-N`` every N steps and at the end;
    ``resume``: continue from such a state (a ``step-N`` folder, or an output folder: its latest), written by
    a run of the same configuration on any number of processes.
    """

    task: str = "mqar"
    task_options: dict = field(default_factory=lambda: {"vocab_size": 8192})
    train_segments: list = field(default_factory=lambda: [(64, 20_000, 4), (128, 20_000, 8), (256, 20_000, 16)])
    test_segments: list = field(default_factory=lambda: [(64, 500, 4), (256, 500, 16), (1024, 500, 64)])
    mixer: str | None = None
    mixer_config: dict = field(default_factory=dict)
    layer_mixers: list | None = None
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
    parallel: str = "none"
    compile: str | None = None
    save_every: int | None = None
    resume: str | None = None

    def __post_init__(self):
        """Every field checked on its own (ValueError naming it); :func:`check_runnable` checks how they combine."""
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}: expected one of {sorted(TASKS)}")
        for name in ("task_options", "mixer_config"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name}: expected a JSON object (dict), got {getattr(self, name)!r}")
        self.train_segments = [as_segment(s) for s in self.train_segments]
        self.test_segments = [as_segment(s) for s in self.test_segments]
        if not self.train_segments or not self.test_segments:
            raise ValueError("expected at least one train and one test segment")
        for name in ("steps", "batch_size", "eval_batch_size", "d_model", "n_layers"):
            _check_number(name, getattr(self, name), 1, integer=True)
        if self.layer_mixers is None:
            self.mixer = DEFAULT_MIXER if self.mixer is None else self.mixer
        else:
            check_layer_mixers(self.layer_mixers, self.n_layers)
            if self.mixer_config:
                raise ValueError(f"mixer_config: with layer_mixers each layer takes its entry's options "
                                 f"({{\"name\": NAME, **options}}); expected {{}}, got {self.mixer_config!r}")
            self.mixer = "+".join(self.layer_names) if self.mixer is None else self.mixer
            check_hybrid_name("mixer: with layer_mixers, the hybrid's name", self.mixer)
        _check_number("seed", self.seed, 0, integer=True)
        _check_number("lr", self.lr, 0, low_open=True, high_open=True)
        _check_number("weight_decay", self.weight_decay, 0, high_open=True)
        _check_number("warmup", self.warmup, 0, 1, high_open=True)
        _check_number("mlp_ratio", self.mlp_ratio, 0, high_open=True)
        _check_number("grad_clip", self.grad_clip, 0, low_open=True)  # inf: no clipping
        if self.early_stop is not None:
            _check_number("early_stop", self.early_stop, 0, 1, low_open=True)  # an accuracy: above 1 never fires
        for name in ("bf16", "checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        for name in ("out_dir", "resume"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: expected a path string or None, got {getattr(self, name)!r}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel: expected one of {list(PARALLEL)}, got {self.parallel!r}")
        if self.compile is not None and self.compile not in torch.compiler.list_backends(exclude_tags=()):
            raise ValueError(f"compile: expected a torch.compile backend {torch.compiler.list_backends()} or None, got {self.compile!r}")
        if self.save_every is not None:
            _check_number("save_every", self.save_every, 1, integer=True)
            if self.out_dir is None:
                raise ValueError("save_every: the training state is written under out_dir; expected an out_dir, got None")

    @property
    def layer_names(self):
        """Each layer's mixer name."""
        return [self.mixer] * self.n_layers if self.layer_mixers is None else [layer_name(e) for e in self.layer_mixers]

    @property
    def max_train_len(self):
        return max(s.seq_len for s in self.train_segments)
