"""``hla2``, ``ahla``, ``hla3``: higher-order linear attention (Zhang, Qin, Gu) in the common shell.

q/k/v projections, short conv + SiLU, q/k post-processing (L2 norm by default: unnormalized HLA outputs
grow polynomially in t, spec/hla.md §8.1), an optional feature map, an optional learned per-token
decay ``g = −exp(A_log)·softplus(a_proj x + dt_bias)`` (on by default), ``ops.hla``, then a per-head
output RMSNorm and ``o_proj``. ``normalize=True`` requires a positive feature map (``elu1`` or ``relu``):
with signed features the denominator changes sign (spec/hla.md §8.3); the config check enforces it.

States per head (spec/hla.md §2.4, §3.2, §4.1; ``dv' = dv + 1`` when normalized, the ones column):
HLA2 ``S (dk×dk) + F (dk×dv')``; AHLA ``P, E (dk×dv')``; HLA3 ``S (dk×dk) + P, F (dk×dv')``.
"""

from dataclasses import dataclass

from polyattn import ops
from polyattn.layers.common import (
    FEATURE_MAPS,
    POSITIVE_FEATURE_MAPS,
    DecayGate,
    MixerConfig,
    QKNorm,
    QKVMixer,
    check_option,
)


@dataclass
class HLAConfig(MixerConfig):
    order: int = 2
    asymmetric: bool = False
    normalize: bool = False
    decay: bool = True
    feature_map: str = "identity"
    qk_norm: str = "l2"
    eps: float = 1e-6


class HigherOrderLinearAttention(QKVMixer):
    registry_name = "hla2"
    config_class = HLAConfig

    def __init__(self, d_model, **config):
        super().__init__(d_model, **config)
        cfg = self.config
        check_option("order", cfg.order, (2, 3))
        check_option("feature_map", cfg.feature_map, FEATURE_MAPS)
        if cfg.asymmetric and cfg.order != 2:
            raise ValueError(f"asymmetric HLA (AHLA) is second order only, got order={cfg.order}")
        if cfg.normalize and cfg.feature_map not in POSITIVE_FEATURE_MAPS:
            raise ValueError(
                f"normalize=True needs a positive feature map, one of {list(POSITIVE_FEATURE_MAPS)}, "
                f"got feature_map={cfg.feature_map!r}"
            )
        self.qk_norm = QKNorm(cfg.qk_norm, self.dk)
        self.decay = DecayGate(d_model, self.heads) if cfg.decay else None

    def mix(self, q, k, v, x, core, use_cache):
        cfg = self.config
        phi = FEATURE_MAPS[cfg.feature_map]
        q, k = phi(self.qk_norm(q)), phi(self.qk_norm(k))
        g = None if self.decay is None else self.decay(x)
        return ops.hla(
            q, k, v, g, order=cfg.order, asymmetric=cfg.asymmetric, normalize=cfg.normalize, eps=cfg.eps,
            initial_state=core, output_final_state=use_cache, impl=self.impl_for(q.shape[1]),
        )

    def core_state_size(self, T):
        cfg = self.config
        dk, dv = self.dk, self.dv + int(cfg.normalize)
        if cfg.asymmetric:
            per_head = 2 * dk * dv
        else:
            per_head = dk * dk + (cfg.order - 1) * dk * dv
        return self.heads * per_head


class AsymmetricHLA(HigherOrderLinearAttention):
    registry_name = "ahla"
    defaults = {"asymmetric": True}


class ThirdOrderHLA(HigherOrderLinearAttention):
    registry_name = "hla3"
    defaults = {"order": 3}
