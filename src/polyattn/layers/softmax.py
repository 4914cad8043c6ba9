"""``softmax``: causal softmax attention (PyTorch SDPA) in the common shell, with a KV cache.

No positional encoding: the short convolution over q/k/v (on by default) gives tokens their local
order, as Zoology's BaseConv does. State after T tokens: the K and V caches, ``H·(dk + dv)·T`` floats,
and which cached keys hold a token (packed runs cache each document in a row of the longest length).
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


class SoftmaxAttention(QKVMixer):
    registry_name = "softmax"
    config_class = SoftmaxConfig
    output_norm = False

    def mix(self, q, k, v, x, core, use_cache, cu_seqlens=None):
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
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)  # [B, H, T, dv]
        else:
            causal = torch.arange(S, device=q.device) <= torch.arange(S - T, S, device=q.device)[:, None]  # [T, S]
            mask = causal & valid[:, None, None, :]  # [B, 1, T, S]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)  # [B, H, T, dv]
        return o.transpose(1, 2), (KVCache(k, v, valid) if use_cache else None)  # [B, H, T, dv] -> [B, T, H, dv]

    def packed_mix(self, q, k, v, use_cache, cu_seqlens):
        """Documents packed in one row (B = 1): causal within each document, nothing across; the cache holds
        document n in row n, ``[N, longest, ...]``, ``valid`` marking its length."""
        T = q.shape[1]
        doc = document_ids(cu_seqlens, T)  # [T]
        pos = torch.arange(T, device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (doc[None, :] == doc[:, None])  # [T, T]
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [1, T, H, D] -> [1, H, T, D]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(1, 2)  # [1, T, H, dv]
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
