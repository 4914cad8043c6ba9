"""A small causal language model around any mixer: embedding, pre-norm blocks, tied head.

Block: ``x = x + mixer(rmsnorm(x))``, then (when ``mlp_ratio > 0``) ``x = x + swiglu(rmsnorm(x))``.
``forward(input_ids, state=None, use_cache=False) -> (logits, state)`` follows the mixers' decoding
protocol with a per-layer list of `MixerState`; ``attention_mask`` (padded rows) and ``cu_seqlens``
(packed documents) go to every mixer, so each sequence gets exactly its own logits (logits at padding
are meaningless); ``generate`` prefills the prompt then decodes token by
token from that state. ``save_pretrained(dir)`` writes ``config.json`` + ``model.safetensors``;
``CausalLM.from_pretrained(dir)`` reads them back.
"""

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from polyattn.layers import MIXERS, RMSNorm, build_mixer
from polyattn.ops.common import check_value

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class LMConfig:
    """``layer_mixers``: optional per-layer list for hybrids, each a mixer name or a dict
    ``{"name": ..., **options}``; layers not given by it use ``mixer`` with ``mixer_config``."""

    vocab_size: int
    d_model: int = 64
    n_layers: int = 2
    mixer: str = "softmax"
    mixer_config: dict = field(default_factory=dict)
    mlp_ratio: float = 4.0
    layer_mixers: list | None = None
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def layer_specs(self):
        """``[(name, options)]`` per layer; raises ValueError on an invalid config."""
        if self.vocab_size < 2 or self.d_model < 1 or self.n_layers < 1 or self.mlp_ratio < 0:
            raise ValueError(
                "expected vocab_size >= 2, d_model >= 1, n_layers >= 1, mlp_ratio >= 0, got "
                f"{self.vocab_size}, {self.d_model}, {self.n_layers}, {self.mlp_ratio}"
            )
        if self.layer_mixers is None:
            specs = [(self.mixer, dict(self.mixer_config))] * self.n_layers
        elif len(self.layer_mixers) != self.n_layers:
            raise ValueError(f"expected {self.n_layers} layer_mixers, got {len(self.layer_mixers)}")
        else:
            specs = []
            for entry in self.layer_mixers:
                if isinstance(entry, str):
                    entry = {"name": entry, **(self.mixer_config if entry == self.mixer else {})}
                options = dict(entry)
                specs.append((options.pop("name"), options))
        for name, _ in specs:
            if name not in MIXERS:
                raise ValueError(f"unknown mixer {name!r}: expected one of {list(MIXERS)}")
        return specs


class SwiGLU(nn.Module):
    def __init__(self, d_model, ratio):
        super().__init__()
        hidden = int(ratio * d_model * 2 / 3)
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config, name, options):
        super().__init__()
        self.mixer_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mixer = build_mixer(name, config.d_model, **options)
        self.mlp = None
        if config.mlp_ratio > 0:
            self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
            self.mlp = SwiGLU(config.d_model, config.mlp_ratio)

    def forward(self, x, state=None, use_cache=False, attention_mask=None, cu_seqlens=None):
        y, state = self.mixer(self.mixer_norm(x), state, use_cache, attention_mask=attention_mask, cu_seqlens=cu_seqlens)
        x = x + y
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x, state


class CausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList([Block(config, name, opts) for name, opts in config.layer_specs()])
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.reset_parameters()

    def reset_parameters(self):
        """N(0, init_std) embeddings (tied head); output projections scaled by 1/sqrt(2·n_layers)."""
        nn.init.normal_(self.embed.weight, std=self.config.init_std)
        for block in self.blocks:
            for module in (block.mixer, block.mlp):
                for name, p in ([] if module is None else module.named_parameters()):
                    if name.endswith(("o_proj.weight", "out_proj.weight", "down.weight")):
                        nn.init.normal_(p, std=self.config.init_std / math.sqrt(2 * self.config.n_layers))

    def hidden_states(self, input_ids, state=None, use_cache=False, attention_mask=None, cu_seqlens=None):
        """``input_ids [B, T]`` -> ``(final-normed hidden [B, T, d_model], per-layer states or None)``."""
        check_token_ids(input_ids, self.config.vocab_size)
        x = self.embed(input_ids)  # [B, T] -> [B, T, d_model]
        states = []
        for i, block in enumerate(self.blocks):
            x, s = block(x, None if state is None else state[i], use_cache, attention_mask, cu_seqlens)
            states.append(s)
        return self.norm(x), (states if use_cache else None)

    def logits(self, hidden):
        """Tied head: ``[..., d_model] -> [..., vocab]``."""
        return hidden @ self.embed.weight.to(hidden.dtype).t()

    def forward(self, input_ids, state=None, use_cache=False, attention_mask=None, cu_seqlens=None):
        hidden, state = self.hidden_states(input_ids, state, use_cache, attention_mask, cu_seqlens)
        return self.logits(hidden), state

    def state_size(self, T):
        """Floats of decoding state per sequence after T tokens, summed over layers."""
        return sum(block.mixer.state_size(T) for block in self.blocks)

    def num_parameters(self):
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens, use_cache=True):
        """Greedy decoding. ``use_cache=True``: prefill once, then one-token steps from the recurrent
        state; ``False``: recompute the whole prefix for every token (the reference)."""
        tokens = input_ids
        if use_cache:
            logits, state = self(input_ids, use_cache=True)
            for _ in range(max_new_tokens):
                nxt = logits[:, -1:].argmax(-1)  # [B, 1]
                tokens = torch.cat([tokens, nxt], dim=1)
                logits, state = self(nxt, state, use_cache=True)
            return tokens
        for _ in range(max_new_tokens):
            logits, _ = self(tokens)
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
        return tokens

    def save_pretrained(self, directory):
        from safetensors.torch import save_model

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        save_model(self, str(directory / WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, directory, map_location="cpu"):
        """Load a folder written by :meth:`save_pretrained`; ValueError naming what is missing or unreadable."""
        from safetensors import SafetensorError
        from safetensors.torch import load_model

        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise ValueError(f"from_pretrained: expected {name} in {str(directory)!r} (a save_pretrained folder), found none")
        try:
            options = json.loads((directory / CONFIG_NAME).read_text())
            config = LMConfig(**options)
        except (ValueError, TypeError) as err:
            raise ValueError(f"from_pretrained: {CONFIG_NAME} in {str(directory)!r} is not a valid LMConfig ({err})") from err
        model = cls(config)
        try:
            load_model(model, str(directory / WEIGHTS_NAME), device=str(map_location))
        except (SafetensorError, RuntimeError, OSError) as err:
            raise ValueError(f"from_pretrained: {WEIGHTS_NAME} in {str(directory)!r} does not hold this model's weights ({err})") from err
        return model


def check_token_ids(input_ids, vocab_size):
    """``input_ids``: an integer tensor ``[B, T]`` with ids in ``[0, vocab_size)`` (value check without a host sync)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32) or input_ids.dim() != 2:
        got = f"dtype {input_ids.dtype}, shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids: expected an int64 tensor [B, T], got {got}")
    check_value((input_ids >= 0) & (input_ids < vocab_size), f"input_ids: expected token ids in [0, {vocab_size}) (vocab_size)")
