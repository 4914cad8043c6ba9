"""`PolyattnConfig`: the Hugging Face configuration of a `polyattn.models` causal LM (``model_type="polyattn"``)."""

from transformers import PreTrainedConfig

from polyattn.models import LMConfig


class PolyattnConfig(PreTrainedConfig):
    """A causal LM of `polyattn.layers` mixers, with the transformers field names.

    ``mixer``: a name in `polyattn.layers.MIXERS` for every layer, or a list with one entry per layer
    (hybrids), each a name or a dict ``{"name": ..., **options}``; ``mixer_config`` holds the options of
    the layers given by name (e.g. ``{"num_heads": 4}``). ``mlp_ratio = 0`` drops the SwiGLU MLPs. The
    output head is tied to the embedding.
    """

    model_type = "polyattn"

    vocab_size: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 2
    mixer: str | list = "softmax"
    mixer_config: dict | None = None
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.lm_config().layer_specs()  # ValueError on an unknown mixer, a wrong list length, bad sizes

    @classmethod
    def from_lm_config(cls, lm_config, **kwargs):
        """The config of a `polyattn.models.LMConfig` (every layer's mixer and options spelled out)."""
        return cls(
            vocab_size=lm_config.vocab_size, hidden_size=lm_config.d_model, num_hidden_layers=lm_config.n_layers,
            mixer=[{"name": name, **options} for name, options in lm_config.layer_specs()],
            mlp_ratio=lm_config.mlp_ratio, norm_eps=lm_config.norm_eps, init_std=lm_config.init_std, **kwargs,
        )

    def lm_config(self):
        """The equivalent `polyattn.models.LMConfig`."""
        options = dict(self.mixer_config or {})
        if isinstance(self.mixer, str):
            return LMConfig(
                vocab_size=self.vocab_size, d_model=self.hidden_size, n_layers=self.num_hidden_layers,
                mixer=self.mixer, mixer_config=options, mlp_ratio=self.mlp_ratio, norm_eps=self.norm_eps,
                init_std=self.init_std,
            )
        if len(self.mixer) != self.num_hidden_layers:
            raise ValueError(
                f"mixer: expected one entry per layer (num_hidden_layers={self.num_hidden_layers}), got {len(self.mixer)}"
            )
        layers = [{"name": entry, **options} if isinstance(entry, str) else dict(entry) for entry in self.mixer]
        if not all("name" in entry for entry in layers):
            raise ValueError(f"mixer: expected a list of names or dicts with a 'name', got {self.mixer!r}")
        return LMConfig(
            vocab_size=self.vocab_size, d_model=self.hidden_size, n_layers=self.num_hidden_layers,
            mixer=layers[0]["name"], mlp_ratio=self.mlp_ratio, layer_mixers=layers,
            norm_eps=self.norm_eps, init_std=self.init_std,
        )
