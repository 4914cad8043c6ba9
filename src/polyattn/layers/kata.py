"""``kata-m1``, ``kata-m2``, ``kata-s2``, ``deltakata-m1``: KATA (Ghriss & Chakraborty) in the common shell.

Layer shell (ops/kata/README.md, "Layer shell"): bias-free q/k/v projections (the feature width p is the head width,
no extra feature projection), optional short conv (kernel 4, SiLU), optional qk-norm (``"rmsnorm"`` or
``"l2"``), the symmetric-cone kernel ``ops.kata``, a per-head output RMSNorm and ``o_proj``; no output
gate (the denominator plays that role). RoPE is not implemented: the short conv (on by default here,
unlike the 340M DeltaKATA config) supplies local order.

* ``kata-m1``: PSD rank one, κ = (q·k)², normalized; ``kata-m2``: two concatenated groups of dk/2,
  κ = Σ_i (q_i·k_i)²; ``kata-s2``: two summed factors, κ = Σ_{i,j} (q_i·k_j)². M1 uses no qk-norm,
  M2 and S2 RMSNorm (the 340M configs).
* ``deltakata-m1``: the gated delta rule on unit lifted keys ψ(k)/‖ψ(k)‖ with ``beta = sigmoid(b_proj x)``,
  L2 q/k norm, scale 1, unnormalized read.
* ``decay=True`` adds the GatedKATA decay ``g = −exp(A_log)·softplus(a_proj x + dt_bias)``.

State per head: ``P × dv`` (+ the normaliser ``P`` when normalized), ``P = groups·E²`` for concat,
``E²`` for sum (``E = dk / groups``), ``dk`` for the first-order orthant/Lorentz maps.
"""

from dataclasses import dataclass

import torch
from torch import nn

from polyattn.layers.common import DecayGate, MixerConfig, QKNorm, QKVMixer, check_option
from polyattn.ops.common import compute_dtype

FEATURES = ("psd", "orthant", "lorentz")
COMBINES = ("concat", "sum")


@dataclass
class KataConfig(MixerConfig):
    feature: str = "psd"
    groups: int = 1
    combine: str = "concat"
    qk_norm: str = "none"
    decay: bool = False
    delta: bool = False
    eps: float = 1e-6


class KernelizedAttention(QKVMixer):
    registry_name = "kata-m1"
    config_class = KataConfig

    def __init__(self, d_model, **config):
        super().__init__(d_model, **config)
        cfg = self.config
        check_option("feature", cfg.feature, FEATURES)
        check_option("combine", cfg.combine, COMBINES)
        if cfg.groups < 1 or self.dk % cfg.groups:
            raise ValueError(f"expected groups >= 1 dividing head_dim={self.dk}, got {cfg.groups}")
        self.qk_norm = QKNorm(cfg.qk_norm, self.dk)
        self.decay = DecayGate(d_model, self.heads) if cfg.decay else None
        self.b_proj = nn.Linear(d_model, self.heads, bias=False) if cfg.delta else None

    @property
    def group_width(self) -> int:
        """The head width per group of the feature map, ``K / groups`` (ops.kata_auto_forms)."""
        return self.dk // self.config.groups

    def mix(self, q, k, v, x, core, use_cache, cu_seqlens=None, position=0):
        cfg = self.config
        q, k = self.qk_norm(q), self.qk_norm(k)
        g = None if self.decay is None else self.decay(x)
        beta = None if self.b_proj is None else torch.sigmoid(self.b_proj(x).to(compute_dtype(x)))
        return self.ops.kata(
            q, k, v, g, feature=cfg.feature, groups=cfg.groups, combine=cfg.combine,
            normalize=not cfg.delta, beta=beta, eps=cfg.eps, scale=1.0 if cfg.delta else None,
            initial_state=core, output_final_state=use_cache, cu_seqlens=cu_seqlens, impl=self.impl_for(q.shape[1]),
        )

    def feature_dim(self):
        cfg = self.config
        if cfg.feature != "psd":
            return self.dk
        E = self.dk // cfg.groups
        return E * E * (cfg.groups if cfg.combine == "concat" else 1)

    def core_state_size(self, T):
        P = self.feature_dim()
        return self.heads * P * (self.dv + (0 if self.config.delta else 1))


class KataM2(KernelizedAttention):
    registry_name = "kata-m2"
    defaults = {"groups": 2, "combine": "concat", "qk_norm": "rmsnorm"}


class KataS2(KernelizedAttention):
    registry_name = "kata-s2"
    defaults = {"groups": 2, "combine": "sum", "qk_norm": "rmsnorm"}


class DeltaKataM1(KernelizedAttention):
    registry_name = "deltakata-m1"
    defaults = {"delta": True, "qk_norm": "l2"}
