"""KATA with chunk summaries combined by a log-depth associative scan (ops/kata/README.md, "Operating points and cost").

The three stages of the scan operating point: (a) per-chunk summaries ``(Γ_c, [S | z]_c)`` and
intra-chunk outputs, parallel over chunks (``kata_chunk_summaries``); (b) an inclusive
Hillis–Steele prefix scan of ``(initial state, summary_1, ..., summary_NC)`` under
``combine_decayed`` — entry c is the state before chunk c, entry NC the final state — in
``ceil(log2(NC + 1))`` steps; (c) the inter-chunk bilinear reads, parallel over chunks
(``kata_chunk_read``). It costs NC·P·(V + 1) memory for the prefix states.
"""

from __future__ import annotations

from polyattn.ops.common import associative_scan, combine_decayed
from polyattn.ops.kata.chunk import kata_chunked


def scan_states(decays, summaries):
    """Log-depth prefix of chunk summaries: ``[B,H,n]``, ``[B,H,n,P,W]`` -> the states after each, ``[B,H,n,P,W]``."""
    return associative_scan(combine_decayed, (decays, summaries), dim=2)[1]


def kata_scan(
    q, k, v, g=None, *, feature="psd", groups=1, combine="concat", normalize=True, eps=1e-6, scale,
    initial_state=None, output_final_state=False, chunk_size=64,
):
    """Chunked KATA with an associative scan across chunks. Returns ``(o [B,T,H,V], KataState | None)``."""
    return kata_chunked(
        q, k, v, g, prefix=scan_states, feature=feature, groups=groups, combine=combine, normalize=normalize, eps=eps,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
    )
