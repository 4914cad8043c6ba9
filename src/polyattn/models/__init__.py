"""Language models built from `polyattn.layers` mixers."""

from polyattn.models.lm import CausalLM, LMConfig

__all__ = ["CausalLM", "LMConfig"]
