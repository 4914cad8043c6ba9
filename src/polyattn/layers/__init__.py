"""Sequence mixers: every mechanism as an ``nn.Module`` with one decoding protocol.

``build_mixer(name, d_model, **config)`` builds ``MIXERS[name]``; every mixer has
``forward(x [B, T, d_model], state=None, use_cache=False) -> (y, state)`` (``forward(x)`` equals a
prefill with ``use_cache=True`` followed by one-token calls that pass the state back) and
``state_size(T)``: floats a decoder keeps per sequence after T tokens. ``forward(x, cu_seqlens=...)`` runs
packed documents and ``forward(x, attention_mask=...)`` padded rows, each exactly as alone
(`polyattn.layers.common`).

Non-finite input: a NaN or Inf in a token never changes an earlier output of a mixer (softmax included:
`layers.softmax.causal_attention`), in one sequence, across packed documents and after a cache, on the
PyTorch forms. A mixer that computes its log-decay from the input (mamba2, gdn, the HLA mixers, the
log-linear mixers) gets a NaN decay there, which the ops take as non-finite input like one in q, k or v.
The Triton forms of the delta rule and HLA let a non-finite token reach the earlier outputs of its chunk
(ops/README.md, "Guarantees of the Triton forms").
"""

import torch

from polyattn import ops
from polyattn.layers.common import Mixer, MixerConfig, MixerState, RMSNorm, map_state, pack_rows
from polyattn.layers.gdn import GatedDeltaNet, GDNConfig, LogLinearGatedDeltaNet, LogLinearGDNConfig
from polyattn.layers.hla import AsymmetricHLA, HigherOrderLinearAttention, HLAConfig, ThirdOrderHLA
from polyattn.layers.kata import DeltaKataM1, KataConfig, KataM2, KataS2, KernelizedAttention
from polyattn.layers.linear import LinearAttention, LinearConfig
from polyattn.layers.mamba2 import LogLinearMamba2, LogLinearMamba2Config, Mamba2, Mamba2Config
from polyattn.layers.softmax import KVCache, SoftmaxAttention, SoftmaxConfig
from polyattn.ops.common import resolve_impl
from polyattn.ops.delta import DELTA_RULE_FORMS
from polyattn.ops.hla import HLA_FORMS
from polyattn.ops.kata import DELTAKATA_FORMS, KATA_FORMS, kata_auto_forms
from polyattn.ops.linear import LINEAR_ATTN_FORMS
from polyattn.ops.loglinear import LOGLINEAR_ATTN_FORMS

MIXERS = {
    cls.registry_name: cls
    for cls in (
        SoftmaxAttention,
        LinearAttention,
        Mamba2,
        GatedDeltaNet,
        HigherOrderLinearAttention,
        AsymmetricHLA,
        ThirdOrderHLA,
        LogLinearMamba2,
        LogLinearGatedDeltaNet,
        KernelizedAttention,
        KataM2,
        KataS2,
        DeltaKataM1,
    )
}

# the public op each mixer calls (softmax uses PyTorch SDPA)
MIXER_OPS = {
    "linear": "linear_attn",
    "mamba2": "linear_attn",
    "gdn": "delta_rule",
    "hla2": "hla",
    "ahla": "hla",
    "hla3": "hla",
    "loglinear-mamba2": "loglinear_attn",
    "loglinear-gdn": "loglinear_attn",
    "kata-m1": "kata",
    "kata-m2": "kata",
    "kata-s2": "kata",
    "deltakata-m1": "kata",
}


# the forms of that op the mixer chooses from (DeltaKATA: the kata op with beta)
OP_FORMS = {"linear_attn": LINEAR_ATTN_FORMS, "delta_rule": DELTA_RULE_FORMS, "hla": HLA_FORMS,
            "loglinear_attn": LOGLINEAR_ATTN_FORMS, "kata": KATA_FORMS}


def mixer_form(name, impl, T=2, device="cpu", dtype=torch.float32, group_width=16):
    """The form of its op that mixer `name` runs on a call of T tokens with ``impl`` (``"auto"`` resolved
    for inputs on `device` in `dtype`: more than one token as in training, with gradients; one token: the
    ``decode_impl``); ``"sdpa"`` for softmax. ``group_width``: a KATA mixer's head width per group (DeltaKATA's
    chunked kernels take powers of two >= 16), e.g. ``mixer.group_width``."""
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}: expected one of {list(MIXERS)}")
    if name not in MIXER_OPS:
        return "sdpa"
    op, forms = MIXER_OPS[name], OP_FORMS[MIXER_OPS[name]]
    if issubclass(MIXERS[name], DeltaKataM1):
        op, forms = "DeltaKATA", DELTAKATA_FORMS
    if impl == "auto" and op in ("kata", "DeltaKATA"):  # the forms the op's own "auto" picks from (the mixers' KATA maps are PSD; decoding: no gradient)
        forms = kata_auto_forms("psd", T == 1, delta=op == "DeltaKATA", group_width=group_width)
    chosen = resolve_impl(op, impl, forms, torch.empty(1, T, 1, 1, device=device, dtype=dtype))  # [B, T, H, K]
    return impl if forms.get(impl) is chosen else next(form for form, fn in forms.items() if fn is chosen)


def available_mixers():
    """Registered mixers whose op this installation provides."""
    return [name for name in MIXERS if name not in MIXER_OPS or hasattr(ops, MIXER_OPS[name])]


def build_mixer(name, d_model, **config):
    """Build mixer `name` (a key of `MIXERS`) of width `d_model`; unknown names/options raise ValueError."""
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}: expected one of {list(MIXERS)}")
    if name not in available_mixers():
        raise NotImplementedError(f"mixer {name!r} needs ops.{MIXER_OPS[name]}, which this installation lacks")
    return MIXERS[name](d_model, **config)


__all__ = [
    "MIXERS",
    "MIXER_OPS",
    "OP_FORMS",
    "AsymmetricHLA",
    "DeltaKataM1",
    "GDNConfig",
    "GatedDeltaNet",
    "HLAConfig",
    "HigherOrderLinearAttention",
    "KVCache",
    "KataConfig",
    "KataM2",
    "KataS2",
    "KernelizedAttention",
    "LinearAttention",
    "LinearConfig",
    "LogLinearGDNConfig",
    "LogLinearGatedDeltaNet",
    "LogLinearMamba2",
    "LogLinearMamba2Config",
    "Mamba2",
    "Mamba2Config",
    "Mixer",
    "MixerConfig",
    "MixerState",
    "RMSNorm",
    "SoftmaxAttention",
    "SoftmaxConfig",
    "ThirdOrderHLA",
    "available_mixers",
    "build_mixer",
    "map_state",
    "mixer_form",
    "pack_rows",
]
