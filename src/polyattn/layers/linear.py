"""``linear``: plain causal linear attention (Katharopoulos et al.) in the common shell.

``o_t = Σ_{s≤t} (φ(q_t)·φ(k_s)) v_s`` with K^-1/2 scaling, no decay, no denominator; the per-head
output RMSNorm keeps the growing sums in range. State: one ``dk × dv`` matrix per head.
"""

from dataclasses import dataclass

from polyattn.layers.common import FEATURE_MAPS, MixerConfig, QKNorm, QKVMixer, check_option


@dataclass
class LinearConfig(MixerConfig):
    feature_map: str = "identity"
    qk_norm: str = "none"


class LinearAttention(QKVMixer):
    registry_name = "linear"
    config_class = LinearConfig

    def __init__(self, d_model, **config):
        super().__init__(d_model, **config)
        check_option("feature_map", self.config.feature_map, FEATURE_MAPS)
        self.qk_norm = QKNorm(self.config.qk_norm, self.dk)

    def mix(self, q, k, v, x, core, use_cache, cu_seqlens=None, position=0):
        phi = FEATURE_MAPS[self.config.feature_map]
        q, k = phi(self.qk_norm(q)), phi(self.qk_norm(k))
        return self.ops.linear_attn(
            q, k, v, initial_state=core, output_final_state=use_cache, cu_seqlens=cu_seqlens, impl=self.impl_for(q.shape[1])
        )

    def core_state_size(self, T):
        return self.heads * self.dk * self.dv
