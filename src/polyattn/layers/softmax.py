"""``softmax``: causal softmax attention (PyTorch SDPA) in the common shell, with a KV cache.

No positional encoding: the short convolution over q/k/v (on by default) gives tokens their local
order, as Zoology's BaseConv does. Causal for any input (`causal_attention`): a NaN or Inf in a token's
key or value never changes an earlier output. State after T tokens: the K and V caches, ``H·(dk + dv)·T``
floats, and which cached keys hold a token (packed runs cache each document in a row of the longest length).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from polyattn.layers.common import MixerConfig, QKVMixer, document_ids


class KVCache(NamedTuple):
    k: torch.Tensor  # [B, S, H, dk]
    v: torch.Tensor  # [B, S, H, dv]
    valid: torch.Tensor  # [B, S] bool: False where a row is shorter than S (never attended)


@dataclass
class SoftmaxConfig(MixerConfig):
    pass


def causal_attention(qh, kh, vh, *, attn_mask=None, doc_start=None):
    """Causal SDPA over ``qh: [B, H, T, dk]``, ``kh: [B, H, S, dk]``, ``vh: [B, H, S, dv]`` (the queries
    are the last T of S positions) whose outputs never see a later key's NaN or Inf.

    A masked weight is an exact 0, but ``0 · nan = nan`` inside SDPA's products (and a boolean mask is
    added as ``-inf``, which leaves a NaN score NaN): non-finite keys and values enter as zeros, and the
    output entries that the exact softmax makes non-finite are NaN — column c of every query at or after
    a non-finite value in column c, every column of every query at or after a non-finite key.
    ``attn_mask [.., T, S]``: None for ``is_causal``; ``doc_start [S]``: each position's document start
    (packed documents: nothing before it is reached). The extra tensors are 1-byte masks, and int32
    counts on the packed path."""
    T, S = qh.shape[-2], kh.shape[-2]
    bad_k = ~torch.isfinite(kh).all(-1, keepdim=True)  # [B, H, S, 1]
    bad_v = ~torch.isfinite(vh)  # [B, H, S, dv]
    kh, vh = torch.where(bad_k, 0.0, kh), torch.where(bad_v, 0.0, vh)
    if attn_mask is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)  # [B, H, T, dv]
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn_mask)  # [B, H, T, dv]
    bad = bad_k | bad_v  # [B, H, S, dv]
    if doc_start is None:
        first = torch.where(bad.any(-2, keepdim=True), bad.to(torch.uint8).argmax(-2, keepdim=True), S)  # [B, H, 1, dv]
        reached = torch.arange(S - T, S, device=o.device)[:, None] >= first  # [B, H, T, dv]
    else:
        seen = bad.cumsum(-2, dtype=torch.int32)  # [B, H, S, dv]: non-finite entries up to each position
        reached = (seen - F.pad(seen, (0, 0, 1, 0))[..., doc_start, :] > 0)[..., S - T :, :]  # since the document's start
    return torch.where(reached, torch.nan, o)  # [B, H, T, dv]


class SoftmaxAttention(QKVMixer):
    registry_name = "softmax"
    config_class = SoftmaxConfig
    output_norm = False
    supports_context_parallel = False  # no chunk summary: softmax over shards is ring attention, not built here

    def mix(self, q, k, v, x, core, use_cache, cu_seqlens=None, position=0):
        if cu_seqlens is not None:
            return self.packed_mix(q, k, v, use_cache, cu_seqlens)
        B, T = q.shape[:2]
        valid = torch.ones(B, T, dtype=torch.bool, device=q.device)
        if core is not None:
            k = torch.cat([core.k.to(k.dtype), k], dim=1)  # [B, Tc+T, H, dk]
            v = torch.cat([core.v.to(v.dtype), v], dim=1)  # [B, Tc+T, H, dv]
            valid = torch.cat([core.valid, valid], dim=1)  # [B, Tc+T]
        S = k.shape[1]
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, T, H, D] -> [B, H, T, D]
        if S == T:
            o = causal_attention(qh, kh, vh)  # [B, H, T, dv]
        else:
            causal = torch.arange(S, device=q.device) <= torch.arange(S - T, S, device=q.device)[:, None]  # [T, S]
            o = causal_attention(qh, kh, vh, attn_mask=causal & valid[:, None, None, :])  # mask [B, 1, T, S]
        return o.transpose(1, 2), (KVCache(k, v, valid) if use_cache else None)  # [B, H, T, dv] -> [B, T, H, dv]

    def packed_mix(self, q, k, v, use_cache, cu_seqlens):
        """Documents packed in one row (B = 1): causal within each document, nothing across; the cache holds
        document n in row n, ``[N, longest, ...]``, ``valid`` marking its length."""
        T = q.shape[1]
        doc = document_ids(cu_seqlens, T)  # [T]
        pos = torch.arange(T, device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (doc[None, :] == doc[:, None])  # [T, T]
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [1, T, H, D] -> [1, H, T, D]
        o = causal_attention(qh, kh, vh, attn_mask=mask, doc_start=cu_seqlens[doc]).transpose(1, 2)  # [1, T, H, dv]
        if not use_cache:
            return o, None
        longest = int(torch.diff(cu_seqlens).max())
        index = cu_seqlens[:-1, None] + torch.arange(longest, device=q.device)  # [N, S] token of each slot
        valid = index < cu_seqlens[1:, None]  # [N, S]
        index = index.clamp_max(T - 1)
        cache = KVCache(
            torch.where(valid[..., None, None], k[0, index], 0.0),  # [N, S, H, dk]
            torch.where(valid[..., None, None], v[0, index], 0.0),  # [N, S, H, dv]
            valid,
        )
        return o, cache

    def core_state_size(self, T):
        return self.heads * (self.dk + self.dv) * T
