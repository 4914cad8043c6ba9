"""``mamba2`` (Dao & Gu, SSD) and ``loglinear-mamba2`` (ops/loglinear/README.md, "Layers").

Mamba-2 as in fla's ``Mamba2`` (n_groups = 1)::

    in_proj: x -> [ z (d_inner) | xBC (d_inner + 2N) | dt (H) ]          d_inner = expand · d_model
    xBC = silu(conv1d(xBC));  x, B, C = split(xBC)                         x: [B, T, H, P], B, C: [B, T, N]
    dt  = softplus(dt + dt_bias);  g = −exp(A_log) · dt                     A_log init log(1..H)
    y   = linear_attn(q=C, k=B, v=x·dt, g, scale=1) + D·x                   B, C shared by all heads
    out = out_proj(rmsnorm(y · silu(z)))                                    (RMSNormGated, norm after gate)

Defaults follow fla (D = 1, z gate, norm after gate). ``d_skip=False`` / ``output_gate=False`` drop the
D·x skip / the z gate: at small width and short training the skip dominates at init (v = x·dt with
dt ≈ 1e-3…0.1 makes the SSM output ~2 % of D·x in RMS at d_model 64, and the scale-free RMSNorm only
sees the sum), and such models stay at chance on MQAR; ``polyattn demo`` trains without both.

Log-linear Mamba-2 adds ``lam = softplus(Lpar ⊙ l_proj x)`` (``l_proj`` reads the block input, not the
conv output) and calls ``loglinear_attn`` instead. States: ``H·N·P`` floats for Mamba-2, times
``num_levels(T)`` for the log-linear form, plus the conv cache.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from polyattn.layers.common import (
    LevelScales,
    Mixer,
    MixerConfig,
    MixerState,
    RMSNorm,
    ShortConv,
    cast_state,
    inverse_softplus,
    sample_dt,
    softplus,
    split_heads,
)
from polyattn.ops.common import compute_dtype, num_levels
from polyattn.ops.loglinear import widen_levels


@dataclass
class Mamba2Config(MixerConfig):
    """``head_dim`` is Mamba-2's P (None: expand·d_model // num_heads), ``d_state`` its N;
    ``output_gate=False`` drops the z branch (plain RMSNorm before ``out_proj``); ``d_skip=False`` drops
    the ``D·x`` skip (and the parameter D)."""

    d_state: int = 16
    expand: int = 2
    output_gate: bool = True
    d_skip: bool = True


@dataclass
class LogLinearMamba2Config(Mamba2Config):
    max_levels: int = 15


class Mamba2(Mixer):
    registry_name = "mamba2"
    config_class = Mamba2Config

    def __init__(self, d_model, **config):
        super().__init__(d_model, **config)
        cfg = self.config
        self.d_inner = cfg.expand * d_model
        if cfg.head_dim is None and self.d_inner % self.heads:
            raise ValueError(f"expected expand·d_model divisible by num_heads={self.heads}, got {self.d_inner}")
        self.P = cfg.head_dim or self.d_inner // self.heads
        self.d_inner = self.P * self.heads
        self.N = cfg.d_state
        conv_dim = self.d_inner + 2 * self.N
        self.z_dim = self.d_inner if cfg.output_gate else 0
        self.in_proj = nn.Linear(d_model, self.z_dim + conv_dim + self.heads, bias=False)
        self.conv = ShortConv(conv_dim, cfg.conv_size)
        self.dt_bias = nn.Parameter(inverse_softplus(sample_dt(self.heads)))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.heads)) if cfg.d_skip else None
        for p in (self.dt_bias, self.A_log, self.D):
            if p is not None:
                p._no_weight_decay = True
        self.norm = RMSNorm(self.d_inner)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def forward(self, x, state=None, use_cache=False, attention_mask=None, cu_seqlens=None):
        self.check_forward(x, state, use_cache)
        self.check_context_parallel(state, use_cache, attention_mask)
        if attention_mask is not None:
            return self.padded_forward(x, attention_mask, state, use_cache, cu_seqlens)
        if cu_seqlens is not None and self.context_parallel is None:  # context parallel: offsets of the whole row
            self.check_packed(x, state, cu_seqlens)
        H, N = self.heads, self.N
        z, xBC, dt = self.in_proj(x).split([self.z_dim, self.d_inner + 2 * N, H], dim=-1)
        xBC, conv_cache = self.short_conv(xBC, state, cu_seqlens)
        xs, Bm, Cm = xBC.split([self.d_inner, N, N], dim=-1)
        xs = split_heads(xs, H)  # [B, T, H*P] -> [B, T, H, P]
        cdt = compute_dtype(x)
        dt = softplus(dt.to(cdt) + self.dt_bias.to(cdt))  # [B, T, H] fp32
        g = -torch.exp(self.A_log.to(cdt)) * dt  # [B, T, H]
        q = Cm[:, :, None].expand(-1, -1, H, -1)  # [B, T, N] -> [B, T, H, N]
        k = Bm[:, :, None].expand(-1, -1, H, -1)  # [B, T, N] -> [B, T, H, N]
        v = (xs * dt[..., None]).to(xs.dtype)  # [B, T, H, P]
        core, position = (None, 0) if state is None else (state.core, state.position)
        y, core = self.ssd(q, k, v, g, x, core, use_cache, cu_seqlens, position)  # [B, T, H, P]
        if self.D is not None:
            y = y + self.D.to(y.dtype)[:, None] * xs
        y = y.flatten(-2)  # [B, T, H, P] -> [B, T, H*P]
        y = self.norm(y * F.silu(z.to(y.dtype)) if self.z_dim else y)
        out = self.out_proj(y.to(x.dtype))
        if not use_cache:
            return out, None
        return out, MixerState(conv_cache, cast_state(core, x), position + x.shape[1])

    def ssd(self, q, k, v, g, x, core, use_cache, cu_seqlens=None, position=0):
        return self.ops.linear_attn(
            q, k, v, g, scale=1.0, initial_state=core, output_final_state=use_cache, cu_seqlens=cu_seqlens,
            impl=self.impl_for(q.shape[1]),
        )

    def core_state_size(self, T):
        return self.heads * self.N * self.P


class LogLinearMamba2(Mamba2):
    registry_name = "loglinear-mamba2"
    config_class = LogLinearMamba2Config

    def __init__(self, d_model, **config):
        super().__init__(d_model, **config)
        self.lam = LevelScales(d_model, self.heads, self.config.max_levels)

    def ssd(self, q, k, v, g, x, core, use_cache, cu_seqlens=None, position=0):
        lam, core = widen_levels(self.lam(x), core, self.context_length(q.shape[1]), position=position)  # past 2**(max_levels - 1) tokens: more levels
        return self.ops.loglinear_attn(
            q, k, v, lam, g, scale=1.0, initial_state=core, output_final_state=use_cache, cu_seqlens=cu_seqlens,
            impl=self.impl_for(q.shape[1]),
        )

    def core_state_size(self, T):
        return num_levels(T) * self.heads * self.N * self.P
