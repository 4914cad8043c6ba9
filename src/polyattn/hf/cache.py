"""`PolyattnCache`: a transformers `Cache` holding every layer's mixer state.

One `MixerCacheLayer` per model layer holds that layer's `polyattn.layers.MixerState` as the mixer
returned it — recurrent states, log-linear levels and positions, the softmax KV cache, short-conv
tails — so decoding continues exactly. Beam search reorders (and `generate` may repeat or select)
batch rows: every state tensor leads with the batch dimension (`polyattn.layers.map_state`).
Recurrent states cannot be rolled back, so `crop` (assisted decoding) raises.
"""

from transformers.cache_utils import Cache, CacheLayerMixin

from polyattn.layers import map_state


class MixerCacheLayer(CacheLayerMixin):
    """One layer's `MixerState` (None before the first forward)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self):
        super().__init__()
        self.state = None

    def lazy_initialization(self, key_states, value_states):
        raise NotImplementedError("polyattn mixers build their own state; there are no key/value tensors to allocate")

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("polyattn mixers return their state whole: store it with PolyattnCache.store_states")

    def get_seq_length(self):
        return 0 if self.state is None else self.state.position

    def get_mask_sizes(self, query_length):
        return self.get_seq_length() + query_length, 0

    def get_max_length(self):
        return -1

    def map_rows(self, fn):
        self.state = map_state(self.state, fn)

    def reorder_cache(self, beam_idx):
        self.map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        self.map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        self.map_rows(lambda t: t[indices.to(t.device)])

    def crop(self, tokens_to_remove):
        raise NotImplementedError("recurrent mixer states cannot be rolled back (crop), so assisted decoding is unsupported")

    def reset(self):
        self.state = None


class PolyattnCache(Cache):
    """Every layer's mixer state; ``get_seq_length()`` is the number of time steps consumed (padding included)."""

    def __init__(self, num_layers):
        super().__init__(layers=[MixerCacheLayer() for _ in range(num_layers)])

    def mixer_states(self):
        """The per-layer states for `polyattn.models.CausalLM`, or None before the first forward."""
        if self.layers[0].state is None:
            return None
        return [layer.state for layer in self.layers]

    def store_states(self, states):
        if len(states) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} layer states, got {len(states)}")
        for layer, state in zip(self.layers, states):
            layer.state = state
