"""``gdn`` (Gated DeltaNet, Yang et al.) and ``loglinear-gdn`` (ops/loglinear/README.md, "Layers").

Gated DeltaNet as in fla: q/k/v projections, short conv + SiLU, L2-normalised q and k,
``beta = sigmoid(b_proj x)``, ``g = −exp(A_log)·softplus(a_proj x + dt_bias)``, the gated delta rule,
then ``rmsnorm(o) · silu(g_proj x)`` per head and ``o_proj``. State: ``dk × dv`` per head.

Log-linear GDN adds ``lam = softplus(Lpar ⊙ l_proj x)`` ([B, T, H, L], L = 15) and masks the complete
gated-delta attention matrix with the Fenwick levels. Following the official SCALE_LAMBDA, λ takes over
the temperature: q is L2-normalised and the op runs with ``scale=1``. State: one ``dk × dv`` matrix per
Fenwick level in use, ``num_levels(T)`` of them after T tokens.
"""

from dataclasses import dataclass

import torch
from torch import nn

from polyattn.layers.common import DecayGate, LevelScales, MixerConfig, QKVMixer, l2_normalize
from polyattn.ops.common import compute_dtype, num_levels
from polyattn.ops.loglinear import widen_levels


@dataclass
class GDNConfig(MixerConfig):
    """``output_gate=False`` drops the ``silu(g_proj x)`` output gate (plain per-head RMSNorm)."""

    output_gate: bool = True


@dataclass
class LogLinearGDNConfig(GDNConfig):
    max_levels: int = 15


class GatedDeltaNet(QKVMixer):
    registry_name = "gdn"
    config_class = GDNConfig

    def __init__(self, d_model, **config):
        super().__init__(d_model, **config)
        self.b_proj = nn.Linear(d_model, self.heads, bias=False)
        self.decay = DecayGate(d_model, self.heads)

    def gates(self, x):
        return torch.sigmoid(self.b_proj(x).to(compute_dtype(x))), self.decay(x)  # beta, g: [B, T, H] fp32

    def mix(self, q, k, v, x, core, use_cache, cu_seqlens=None, position=0):
        beta, g = self.gates(x)
        q, k = l2_normalize(q), l2_normalize(k)
        return self.ops.delta_rule(
            q, k, v, beta, g, initial_state=core, output_final_state=use_cache, cu_seqlens=cu_seqlens,
            impl=self.impl_for(q.shape[1]),
        )

    def core_state_size(self, T):
        return self.heads * self.dk * self.dv


class LogLinearGatedDeltaNet(GatedDeltaNet):
    registry_name = "loglinear-gdn"
    config_class = LogLinearGDNConfig

    def __init__(self, d_model, **config):
        super().__init__(d_model, **config)
        self.lam = LevelScales(d_model, self.heads, self.config.max_levels)

    def mix(self, q, k, v, x, core, use_cache, cu_seqlens=None, position=0):
        beta, g = self.gates(x)
        q, k = l2_normalize(q), l2_normalize(k)
        lam, core = widen_levels(self.lam(x), core, self.context_length(q.shape[1]), position=position)  # [B, T, H, L] fp32; more levels past 2**(L-1) tokens
        return self.ops.loglinear_attn(
            q, k, v, lam, g, beta=beta, scale=1.0,
            initial_state=core, output_final_state=use_cache, cu_seqlens=cu_seqlens, impl=self.impl_for(q.shape[1]),
        )

    def core_state_size(self, T):
        return num_levels(T) * self.heads * self.dk * self.dv
