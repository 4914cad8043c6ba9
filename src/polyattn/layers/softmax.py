"""``softmax``: causal softmax attention (PyTorch SDPA) in the common shell, with a KV cache.

No positional encoding: the short convolution over q/k/v (on by default) gives tokens their local
order, as Zoology's BaseConv does. State after T tokens: the K and V caches, ``H·(dk + dv)·T`` floats.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from polyattn.layers.common import MixerConfig, QKVMixer


@dataclass
class SoftmaxConfig(MixerConfig):
    pass


class SoftmaxAttention(QKVMixer):
    registry_name = "softmax"
    config_class = SoftmaxConfig
    output_norm = False

    def mix(self, q, k, v, x, core, use_cache):
        T = q.shape[1]
        if core is not None:
            k = torch.cat([core[0].to(k.dtype), k], dim=1)  # [B, Tc+T, H, dk]
            v = torch.cat([core[1].to(v.dtype), v], dim=1)  # [B, Tc+T, H, dv]
        S = k.shape[1]
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, T, H, D] -> [B, H, T, D]
        if S == T:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)  # [B, H, T, dv]
        else:
            mask = torch.arange(S, device=q.device) <= torch.arange(S - T, S, device=q.device)[:, None]  # [T, S]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)  # [B, H, T, dv]
        return o.transpose(1, 2), ((k, v) if use_cache else None)  # [B, H, T, dv] -> [B, T, H, dv]

    def core_state_size(self, T):
        return self.heads * (self.dk + self.dv) * T
