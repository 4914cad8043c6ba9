"""`PolyattnForCausalLM`: `polyattn.models.CausalLM` as a transformers `PreTrainedModel` + `GenerationMixin`.

The network is `polyattn.models.CausalLM` itself (held as ``self.model``; one implementation for every
mixer and hybrid), so ``save_pretrained`` / ``from_pretrained`` write and read its weights (safetensors)
under ``model.``. ``forward`` takes the transformers arguments: ``attention_mask`` (left-padded prompts:
each row gets exactly its own logits, `polyattn.layers.common`), ``cache`` (a `PolyattnCache`, created
when ``use_cache``, which defaults to ``config.use_cache`` outside training), ``labels`` (shifted inside, -100 ignored) and ``logits_to_keep``; also
``cu_seqlens`` for packed documents (B = 1; no loss across a document boundary). No positional
encoding: ``position_ids`` are accepted and unused.
"""

import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from polyattn.hf.cache import PolyattnCache
from polyattn.hf.configuration import PolyattnConfig
from polyattn.models import CausalLM

IGNORE_INDEX = -100


class PolyattnPreTrainedModel(PreTrainedModel):
    config_class = PolyattnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _is_stateful = True  # recurrent states cannot be rolled back: no assisted decoding

    def _init_weights(self, module):
        """Nothing: `CausalLM` and the mixers initialise their parameters when built (`polyattn.models`), and
        checkpoints hold every weight."""

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # forward creates a PolyattnCache


class PolyattnForCausalLM(PolyattnPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = CausalLM(config.lm_config())
        self.post_init()

    @classmethod
    def from_causal_lm(cls, lm, **config_kwargs):
        """This model with the weights of a `polyattn.models.CausalLM` (e.g. a ``polyattn train`` checkpoint),
        in its dtype; ``config_kwargs`` go to `PolyattnConfig` (e.g. ``eos_token_id``)."""
        model = cls(PolyattnConfig.from_lm_config(lm.config, **config_kwargs))
        model.model.load_state_dict(lm.state_dict())
        return model.to(next(lm.parameters()).dtype)

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        cache=None,
        use_cache=None,
        labels=None,
        position_ids=None,
        cu_seqlens=None,
        logits_to_keep=0,
        return_dict=None,
        **kwargs,
    ):
        if input_ids is None:
            raise ValueError("expected input_ids [B, T] (inputs_embeds is not supported), got None")
        unsupported = sorted(key for key, value in kwargs.items() if value not in (None, False))
        if unsupported:
            raise ValueError(f"unsupported arguments {unsupported}: expected input_ids, attention_mask, cache, labels, cu_seqlens")
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        use_cache = use_cache or cache is not None
        if use_cache and cache is None:
            cache = PolyattnCache(self.config.num_hidden_layers)
        states = None if cache is None else cache.mixer_states()
        T = input_ids.shape[1]
        if attention_mask is not None:
            if states is not None:
                attention_mask = attention_mask[:, -T:]  # the cached past is in the states
            if bool((attention_mask != 0).all()):
                attention_mask = None
        hidden, states = self.model.hidden_states(input_ids, states, use_cache, attention_mask, cu_seqlens)
        if use_cache:
            cache.store_states(states)
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        logits = self.model.logits(hidden[:, keep])  # [B, T, d_model] -> [B, kept, vocab]
        loss = None
        if labels is not None:
            loss = self.loss(self.model.logits(hidden) if logits_to_keep else logits, labels, cu_seqlens)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)
        return output if return_dict is not False else output.to_tuple()

    @staticmethod
    def loss(logits, labels, cu_seqlens=None):
        """Next-token cross-entropy: position t predicts ``labels[:, t + 1]``; -100 is ignored, and with
        ``cu_seqlens`` so is every document's first token (no prediction across a boundary)."""
        if labels.shape != logits.shape[:2]:
            raise ValueError(f"labels: expected shape {tuple(logits.shape[:2])} ([B, T]), got {tuple(labels.shape)}")
        target = labels[:, 1:].clone()  # [B, T-1]
        if cu_seqlens is not None:
            target[:, cu_seqlens[1:-1] - 1] = IGNORE_INDEX
        return F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE_INDEX
        )  # [B*(T-1), vocab]

    def state_size(self, T):
        """Floats of decoding state per sequence after T tokens (`CausalLM.state_size`)."""
        return self.model.state_size(T)
