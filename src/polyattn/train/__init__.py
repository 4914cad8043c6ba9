"""Training and evaluation on the synthetic recall tasks: `train`, `sweep`, and the CPU `demo`."""

from polyattn.train.config import TrainConfig
from polyattn.train.loop import build_data, build_model, evaluate, train

__all__ = ["TrainConfig", "build_data", "build_model", "evaluate", "train"]
