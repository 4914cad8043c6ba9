"""``hla2``, ``ahla``, ``hla3``: higher-order linear attention (Zhang, Qin, Gu) in the common shell.

q/k/v projections, short conv + SiLU, q/k post-processing (L2 norm by default: unnormalized HLA outputs
grow polynomially in t, spec/hla.md §8.1), an optional feature map, an optional learned per-token
decay ``g = −exp(A_log)·softplus(a_proj x + dt_bias)`` (on by default), ``ops.hla``, then a per-head
output RMSNorm and ``o_proj``.

HLA has no published experiments, so the shell is ours. The decay: the composed calls forget at up to
``m·g`` (``m`` = 2 for HLA2's outer call ``2g``, 3 for HLA3's ``3g``, 1 for AHLA, whose pair weights decay
as ``g^{t-j}``), so the gate's ``A`` is drawn from ``U(0, 16/m)``: the fastest composed decay then starts
in the range of a first-order gate (Gated DeltaNet, ``A ~ U(0, 16)``) instead of m times faster, which
forgets a key within a few tokens. Measured on ``polyattn demo``'s MQAR (450 steps, lr 3e-2, length-64
accuracy, single runs that vary by about ±0.2 at this LR): HLA3 0.23 with ``U(0, 16)``, 0.54 with
``U(0, 16/3)``, 0.65 without decay.

HLA2 does not learn that MQAR in 450 steps with any shell we tried (length-64 accuracy, lr 1e-2 unless
noted): as here 0.06; lr 3e-2 0.01; no decay at lr 3e-2 0.05; no decay and no q/k norm 0.07; q/k RMSNorm
0.03; relu 0.09 (no decay 0.11); elu+1 0.05; normalized relu 0.07; 8 heads 0.03; ``scale=1`` 0.04;
output-norm eps 1e-12 0.04; q, k projections equal at init 0.05; ``A ~ U(0, 8)`` at lr 3e-2 0.05; 1500
steps 0.10. Its weight for value j, ``q_tᵀ S_j q_j``, compares two *queries* under the key moment, so
recall needs two coupled alignments that get no consistent gradient from a random start. AHLA learns
(0.80 at lr 3e-2). ``normalize=True`` requires a positive feature map (``elu1`` or ``relu``):
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
        rate = 1 if cfg.asymmetric else cfg.order  # the fastest composed decay is rate·g
        self.decay = DecayGate(d_model, self.heads, a_max=16.0 / rate) if cfg.decay else None

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
