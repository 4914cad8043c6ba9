"""Building blocks shared by the mixers: norms, the causal short convolution, q/k post-processing,
gate parameterisations, the mixer base class and its streaming state.

Decoding protocol (every mixer): ``forward(x, state=None, use_cache=False) -> (y, state)`` on
``x: [B, T, d_model]``. With ``use_cache=True`` the returned `MixerState` continues the sequence exactly:
``forward(x)`` equals ``forward(x[:, :t], use_cache=True)`` followed by calls on the remaining tokens
that pass the state back. States hold fp32 tensors (float64 when the input is float64).

Packed and padded batches (every mixer): ``forward(x, cu_seqlens=...)`` runs documents packed into one
row (``x: [1, T, d_model]``, int64 offsets ``[N + 1]``) with the state reset at every boundary, the short
convolution included; with ``use_cache=True`` the state holds one entry per document (``[N, ...]``), so
one-token calls on ``[N, 1, d_model]`` continue each document. ``forward(x, attention_mask=...)``
(``[B, T]``, 1 = token, 0 = padding, e.g. a left-padded prompt) gives every row exactly what its tokens
give alone: the tokens are packed into one row by `pack_rows`, run with ``cu_seqlens``, and put back
(zeros at the padding). Padding is for prompts: with a state, ``attention_mask`` must be all ones.
"""

import contextlib
import math
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from polyattn import ops
from polyattn.ops.common import FORMS, check_cu_seqlens, check_flag, check_positive, check_value, compute_dtype


class MixerState(NamedTuple):
    """What a mixer carries between calls: the short-conv cache and the mechanism's own state."""

    conv: torch.Tensor | None  # [B, conv_size - 1, channels] last inputs of the short conv
    core: Any  # the op's final_state (tensor or NamedTuple), or the KV cache for softmax
    position: int  # time steps of the batch layout consumed so far (padding included)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32 (float64 stays float64), learnable scale."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate=None):
        """``gate`` given: ``rmsnorm(x) · silu(gate)`` (fla's FusedRMSNormGated, norm before gate)."""
        dt = compute_dtype(x)
        y = x.to(dt)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(dt)
        if gate is not None:
            y = y * F.silu(gate.to(dt))
        return y.to(x.dtype)


class ShortConv(nn.Module):
    """Causal depthwise Conv1d (kernel `size`) + SiLU over ``[B, T, C]``, with a cache of the last inputs.

    Written as `size` shifted multiply-adds (same weights layout as ``nn.Conv1d(groups=C)``): on CPU this is
    much faster than the depthwise convolution kernels, backward included."""

    def __init__(self, channels, size=4):
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(torch.empty(channels, 1, size))
        self.bias = nn.Parameter(torch.zeros(channels))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x, cache=None, cu_seqlens=None, first_offset=0):
        """``x: [B, T, C]``, ``cache: [B, size-1, C]`` or None -> ``(silu(conv(x)) [B, T, C], new cache)``.

        ``cu_seqlens`` (B = 1): no tap reads across a document boundary, and the new cache holds each
        document's last ``size - 1`` inputs (zeros before its start), ``[N, size-1, C]``. A cache with
        ``cu_seqlens`` holds the tokens before the row (context parallelism: the previous shard's tail), of
        which the first document has ``first_offset``."""
        B, T, C = x.shape
        if cache is None:
            cache = x.new_zeros(B, self.size - 1, C)
        xp = torch.cat([cache.to(x.dtype), x], dim=1)  # [B, size-1+T, C]
        w = self.weight[:, 0].to(x.dtype)  # [C, size]
        taps = [xp[:, i : i + T] for i in range(self.size)]  # tap i reads token t - (size-1-i)
        if cu_seqlens is not None:
            offset = document_offsets(cu_seqlens, T)  # [T] index of each token in its document
            offset = offset + first_offset * (offset == torch.arange(T, device=x.device))  # the first document began earlier
            taps = [torch.where((offset >= self.size - 1 - i)[:, None], tap, 0.0) for i, tap in enumerate(taps)]
        y = self.bias.to(x.dtype) + sum(tap * w[:, i] for i, tap in enumerate(taps))  # [B, T, C]
        if cu_seqlens is None:
            return F.silu(y), xp[:, -(self.size - 1) :]
        bos, eos = cu_seqlens[:-1, None], cu_seqlens[1:, None]  # [N, 1]
        last = eos - (self.size - 1) + torch.arange(self.size - 1, device=x.device)  # [N, size-1] token indices
        tail = torch.where((last >= bos)[..., None], xp[0, last + self.size - 1], 0.0)  # [N, size-1, C]
        return F.silu(y), tail


def document_ids(cu_seqlens, T):
    """Each packed token's document: ``[T]`` int64."""
    return torch.searchsorted(cu_seqlens[1:], torch.arange(T, device=cu_seqlens.device), right=True)


def document_offsets(cu_seqlens, T):
    """Each packed token's index inside its document: ``[T]`` int64."""
    return torch.arange(T, device=cu_seqlens.device) - cu_seqlens[document_ids(cu_seqlens, T)]


def pack_rows(x, attention_mask):
    """The tokens of each row of ``x [B, T, ...]`` where ``attention_mask [B, T]`` is nonzero, packed into
    one row: ``(x_packed [1, total, ...], cu_seqlens [B + 1] int64, keep [B, T] bool)``."""
    if attention_mask.shape != x.shape[:2]:
        raise ValueError(f"attention_mask: expected shape {tuple(x.shape[:2])} ([B, T]), got {tuple(attention_mask.shape)}")
    keep = attention_mask.to(device=x.device) != 0  # [B, T]
    lengths = keep.sum(1)  # [B]
    message = "attention_mask: expected at least one token (a nonzero entry) in every row"
    check_value(lengths > 0, message, detail=lambda: f"{message}, got lengths {lengths.tolist()}")
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))  # [B + 1]
    return x[keep][None], cu_seqlens, keep  # [B, T, ...] -> [1, total, ...]


def split_heads(x, heads):
    """``[B, T, H*D] -> [B, T, H, D]``."""
    return x.unflatten(-1, (heads, -1))


def l2_normalize(x, eps=1e-6):
    """Unit rows in x's dtype (under autocast the norm computes in fp32; q, k and v must share a dtype)."""
    return (x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


FEATURE_MAPS = {
    "identity": lambda x: x,
    "elu1": lambda x: F.elu(x) + 1.0,
    "relu": F.relu,
}
POSITIVE_FEATURE_MAPS = ("elu1", "relu")
QK_NORMS = ("none", "l2", "rmsnorm")


class QKNorm(nn.Module):
    """q/k post-processing per head: ``"none"``, ``"l2"`` (parameter-free) or ``"rmsnorm"`` (learnable)."""

    def __init__(self, kind, head_dim):
        super().__init__()
        check_option("qk_norm", kind, QK_NORMS)
        self.kind = kind
        self.norm = RMSNorm(head_dim) if kind == "rmsnorm" else None

    def forward(self, x):
        if self.kind == "l2":
            return l2_normalize(x)
        if self.kind == "rmsnorm":
            return self.norm(x)
        return x


class DecayGate(nn.Module):
    """Mamba-2 / GDN log-decay ``g = −exp(A_log) · softplus(a_proj x + dt_bias)`` per (token, head).

    Init as fla's Gated DeltaNet: ``A ~ U(0, a_max)`` with ``a_max = 16``, ``dt ~ logU(1e-3, 0.1)`` floored
    at 1e-4, ``dt_bias = softplus⁻¹(dt)`` (ops/loglinear/README.md, "Layers").
    """

    def __init__(self, d_model, heads, a_max=16.0):
        super().__init__()
        self.a_proj = nn.Linear(d_model, heads, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1e-4, a_max)))
        self.dt_bias = nn.Parameter(inverse_softplus(sample_dt(heads)))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True

    def forward(self, x):
        dt = compute_dtype(x)
        return -torch.exp(self.A_log.to(dt)) * softplus(self.a_proj(x).to(dt) + self.dt_bias.to(dt))  # [B, T, H]


def softplus(x):
    """``log(1 + e^x)`` as ``logaddexp(x, 0)``: the same function and gradient (``sigmoid(x)``) as
    ``F.softplus``, whose backward op breaks ``torch.compile(backend="aot_eager")``: with the gradient
    arriving in the chunk forms' head-major layout, the traced graph expects its output contiguous, eager
    returns it in that layout, and the linear layer's backward view of it fails (pytorch/pytorch#120035)."""
    return torch.logaddexp(x, x.new_zeros(()))


def sample_dt(n, dt_min=1e-3, dt_max=0.1, floor=1e-4):
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return dt.clamp_min(floor)


def inverse_softplus(x):
    return x + torch.log(-torch.expm1(-x))


class LevelScales(nn.Module):
    """Log-linear λ (ops/loglinear/README.md, "Layers"): ``lam = softplus(Lpar ⊙ l_proj x)``, ``[B, T, H, L]``.

    ``l_proj ~ N(0, 0.006)`` and ``Lpar = 1``, so λ ≈ ln 2 at init. L (``max_levels``, 15 by default)
    levels cover ``2**(L-1)`` tokens (16K); longer sequences and decoding past that add levels that
    share the last level's λ (``ops.loglinear.widen_levels``), so any length is served.
    """

    def __init__(self, d_model, heads, levels):
        super().__init__()
        self.heads, self.levels = heads, levels
        self.l_proj = nn.Linear(d_model, heads * levels, bias=False)
        nn.init.normal_(self.l_proj.weight, std=0.006)
        self.L = nn.Parameter(torch.ones(heads, levels))
        self.L._no_weight_decay = True

    def forward(self, x):
        dl = split_heads(self.l_proj(x), self.heads)  # [B, T, H*L] -> [B, T, H, L] ("(h ell)" head-major)
        return softplus(self.L.to(compute_dtype(x)) * dl.to(compute_dtype(x)))


def check_option(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def map_state(state, fn):
    """`state` (a `MixerState`, an op state, or nested tuples of them) with ``fn`` applied to every tensor;
    every state tensor leads with the batch (or document) dimension, so ``fn`` may select, reorder or
    repeat rows (beam search)."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if not isinstance(state, tuple):
        return state  # positions (int) and absent parts (None)
    parts = [map_state(s, fn) for s in state]
    return type(state)(*parts) if hasattr(state, "_fields") else tuple(parts)


MIN_INT_OPTION = {"conv_size": 2}  # every other integer option is a count >= 1


def check_config(config, mixer):
    """Every option of a mixer config against its declared type: bools are bools, integers positive
    integers (``int | None``: or None), floats positive and finite, ``impl``/``decode_impl`` known forms;
    the values of the other strings are checked where they are used."""
    for f in fields(config):
        value, where = getattr(config, f.name), f"{f.name} (mixer {mixer!r})"
        if f.type is bool:
            check_flag(where, value)
        elif f.type in (int, int | None):
            low = MIN_INT_OPTION.get(f.name, 1)
            if not (value is None and f.type != int) and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{where}: expected an integer >= {low}{' or None' if f.type != int else ''}, got {value!r}")
        elif f.type is float:
            check_positive(where, value)
        elif f.type is str and not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
    for name in ("impl", "decode_impl"):
        check_option(f"{name} (mixer {mixer!r})", getattr(config, name), ("auto", *FORMS))


def cast_state(state, x):
    """States are fp32 (float64 stays float64), whatever dtype autocast computed them in."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state.to(compute_dtype(x)) if state.is_floating_point() else state
    parts = [cast_state(s, x) for s in state]
    return type(state)(*parts) if hasattr(state, "_fields") else tuple(parts)


@dataclass
class MixerConfig:
    """Options shared by every mixer. ``head_dim=None`` means ``d_model // num_heads``; ``impl`` is the op
    form for prompts and training, ``decode_impl`` the one for one-token calls (``"auto"``: the fused
    Triton step on CUDA where the op has one, the token loop elsewhere)."""

    num_heads: int = 2
    head_dim: int | None = None
    expand_v: int = 1
    short_conv: bool = True
    conv_size: int = 4
    impl: str = "auto"
    decode_impl: str = "auto"


class Mixer(nn.Module):
    """Base class: holds the config, validates it, and defines the decoding protocol and state size."""

    config_class = MixerConfig
    defaults: dict = {}
    context_parallel = None  # a polyattn.distributed.ContextParallel: the sequence is sharded across its ranks
    supports_context_parallel = True

    def __init__(self, d_model, **config):
        super().__init__()
        names = {f.name for f in fields(self.config_class)}
        unknown = sorted(set(config) - names)
        if unknown:
            raise ValueError(f"unknown options {unknown} for mixer {self.name!r}: expected some of {sorted(names)}")
        self.config = self.config_class(**{**self.defaults, **config})
        check_config(self.config, self.name)
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model: expected a positive integer, got {d_model!r}")
        self.d_model = d_model
        cfg = self.config
        if cfg.head_dim is None and d_model % cfg.num_heads:
            raise ValueError(f"expected d_model divisible by num_heads={cfg.num_heads}, got {d_model}")
        self.heads = cfg.num_heads
        self.dk = cfg.head_dim or d_model // cfg.num_heads
        self.dv = self.dk * cfg.expand_v

    @property
    def name(self):
        return getattr(type(self), "registry_name", type(self).__name__)

    def check_forward(self, x, state, use_cache):
        """The checks every forward starts with: ``x [B, T, d_model]`` floating, ``use_cache`` a bool, and
        ``state`` a `MixerState` whose tensors all lead with B (what a call with ``use_cache=True`` returned)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model or not x.is_floating_point():
            got = f"shape {tuple(x.shape)}, dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected a floating tensor [B, T, d_model] with d_model = {self.d_model}, got {got}")
        check_flag("use_cache", use_cache)
        if state is None:
            return
        if not isinstance(state, MixerState):
            raise ValueError(f"state: expected the MixerState of a call with use_cache=True, got {type(state).__name__}")
        rows = []
        map_state(state, lambda t: rows.append(t.shape[0] if t.dim() else None))
        if any(n != x.shape[0] for n in rows):
            raise ValueError(f"state: expected every tensor to lead with the batch size B = {x.shape[0]} of x, got {rows}")

    def impl_for(self, T):
        """The op form for a call on T tokens."""
        return self.config.decode_impl if T == 1 else self.config.impl

    @property
    def ops(self):
        """The ops this mixer calls: `polyattn.ops`, or their context-parallel forms (``context_parallel`` set,
        by ``polyattn.distributed.enable_context_parallel``)."""
        return ops if self.context_parallel is None else self.context_parallel

    def context_length(self, T):
        """Tokens of the whole sequence when this call holds T of them (T without context parallelism)."""
        return T if self.context_parallel is None else self.context_parallel.context_length(T)

    def ordered_exchanges(self):
        """A scope whose context-parallel exchanges run their backward in reverse order on every rank."""
        return contextlib.nullcontext() if self.context_parallel is None else self.context_parallel.ordered()

    def short_conv(self, x, state, cu_seqlens):
        """``self.conv`` over ``x [B, T, C]``; with context parallelism its cache is the previous shard's tail."""
        cp = self.context_parallel
        if cp is None:
            return self.conv(x, None if state is None else state.conv, cu_seqlens)
        if state is not None:
            raise ValueError("state: context parallelism runs whole sequences (training, prefill without a cache), got a state")
        _, shard, local_cu = cp.layout(x, cu_seqlens)
        halo = cp.conv_halo(x, self.conv.size - 1)  # [B, size-1, C]
        return self.conv(x, halo, local_cu, first_offset=shard.first_position)

    def check_context_parallel(self, state, use_cache, attention_mask):
        """Context parallelism runs whole sequences: no state, no cache, packed documents by ``cu_seqlens``."""
        if self.context_parallel is not None and (state is not None or use_cache or attention_mask is not None):
            raise ValueError(
                "context parallelism: expected state=None, use_cache=False and no attention_mask (pack documents with "
                f"cu_seqlens), got state={'set' if state is not None else None}, use_cache={use_cache}, "
                f"attention_mask={'set' if attention_mask is not None else None}"
            )

    def conv_state_size(self):
        """Floats in the short-conv cache (per sequence)."""
        return 0 if self.conv is None else (self.config.conv_size - 1) * self.conv.weight.shape[0]

    def core_state_size(self, T):
        raise NotImplementedError

    def state_size(self, T):
        """Floats a decoder keeps per sequence after T tokens: mechanism state + short-conv cache."""
        return self.core_state_size(T) + self.conv_state_size()

    def check_packed(self, x, state, cu_seqlens):
        """``cu_seqlens`` runs start fresh documents: B = 1, valid offsets, no state."""
        check_cu_seqlens(cu_seqlens, x)
        if state is not None:
            raise ValueError("cu_seqlens: expected state=None (packed documents start fresh), got a state")

    def padded_forward(self, x, attention_mask, state, use_cache, cu_seqlens):
        """``forward`` with ``attention_mask [B, T]``: each row's tokens run alone (module docstring)."""
        if cu_seqlens is not None:
            raise ValueError("expected attention_mask (padded rows) or cu_seqlens (packed documents), got both")
        if state is not None:
            check_value(attention_mask != 0, "attention_mask: expected all ones with a state (padding belongs to the prompt), got zeros")
            return self(x, state, use_cache)
        packed, cu_seqlens, keep = pack_rows(x, attention_mask)  # [B, T, d_model] -> [1, total, d_model]
        y_packed, state = self(packed, use_cache=use_cache, cu_seqlens=cu_seqlens)
        y = y_packed.new_zeros(*keep.shape, y_packed.shape[-1])
        y[keep] = y_packed[0]  # [1, total, d_model] -> [B, T, d_model], zeros at the padding
        return y, (state._replace(position=x.shape[1]) if use_cache else None)


class QKVMixer(Mixer):
    """The common shell (fla's linear-attention layer; ops/kata/README.md, "Layer shell"): bias-free q/k/v
    projections, optional short conv (SiLU) over [q|k|v], a per-head output RMSNorm (gated by
    ``silu(g_proj x)`` when the config has ``output_gate=True``) and an output projection.
    Subclasses implement `mix(q, k, v, x, core_state, use_cache, cu_seqlens, position) -> (o [B,T,H,dv],
    core_state)`, ``position`` the steps the state has run (`MixerState.position`, 0 without a state)."""

    output_norm = True

    def __init__(self, d_model, **config):
        super().__init__(d_model, **config)
        H, dk, dv = self.heads, self.dk, self.dv
        self.q_proj = nn.Linear(d_model, H * dk, bias=False)
        self.k_proj = nn.Linear(d_model, H * dk, bias=False)
        self.v_proj = nn.Linear(d_model, H * dv, bias=False)
        self.conv = ShortConv(H * (2 * dk + dv), self.config.conv_size) if self.config.short_conv else None
        self.o_norm = RMSNorm(dv) if self.output_norm else None
        self.g_proj = nn.Linear(d_model, H * dv, bias=False) if getattr(self.config, "output_gate", False) else None
        self.o_proj = nn.Linear(H * dv, d_model, bias=False)

    def forward(self, x, state=None, use_cache=False, attention_mask=None, cu_seqlens=None):
        self.check_forward(x, state, use_cache)
        self.check_context_parallel(state, use_cache, attention_mask)
        if attention_mask is not None:
            return self.padded_forward(x, attention_mask, state, use_cache, cu_seqlens)
        if cu_seqlens is not None and self.context_parallel is None:  # context parallel: offsets of the whole row
            self.check_packed(x, state, cu_seqlens)
        H, dk = self.heads, self.dk
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [B, T, H*(2dk+dv)]
        conv_cache = None
        if self.conv is not None:
            qkv, conv_cache = self.short_conv(qkv, state, cu_seqlens)
        q, k, v = qkv.split([H * dk, H * dk, H * self.dv], dim=-1)
        q, k, v = (split_heads(t, H) for t in (q, k, v))  # [B, T, H*D] -> [B, T, H, D]
        core = None if state is None else state.core
        position = 0 if state is None else state.position
        o, core = self.mix(q, k, v, x, core, use_cache, cu_seqlens, position)  # [B, T, H, dv]
        if self.o_norm is not None:
            o = self.o_norm(o, None if self.g_proj is None else split_heads(self.g_proj(x), H))
        o = o.flatten(-2)  # [B, T, H, dv] -> [B, T, H*dv]
        y = self.o_proj(o.to(x.dtype))
        if not use_cache:
            return y, None
        return y, MixerState(conv_cache, cast_state(core, x), position + x.shape[1])
