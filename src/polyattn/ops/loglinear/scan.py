"""Log-linear attention with the states between chunks from a log-depth associative scan
(ops/loglinear/README.md, "Associative combine").

A stretch of tokens from the query ``p - 1`` to the query ``e`` maps the per-level state ``h`` (the view
of query ``p - 1``) to ``merge_m(T h) + b``: ``T`` the stretch's transition (the decay ``exp(a)``, or the
delta-rule product ``M = A_e ⋯ A_p``, the same for every level), ``b`` the stretch's own keys in the
levels of query ``e`` (from a zero state), and ``m = level(e, p - 1)``: a key in level ``l`` of query
``p - 1`` sits in level ``max(l, m)`` of query ``e``, so ``merge_m`` sums levels ``0..m`` into ``m``.
Two stretches in a row give ``(T₂T₁, merge_{m₂}(T₂ b₁) + b₂, max(m₁, m₂))`` (merges commute with the
transition and ``merge_{m₂} ∘ merge_{m₁} = merge_{max}``): an associative combine. Per chunk (aligned
to absolute positions as in :mod:`chunk`): the element from a zero state, an inclusive scan over
``[initial state, chunk 0, …]``, then every chunk's outputs from the state entering it, read at level
``max(l, level(t, p - 1))``. The same combine joins the shards of context parallelism.
"""

from __future__ import annotations

import torch

from polyattn.ops.common import associative_scan, heads_unchunk
from polyattn.ops.loglinear.chunk import chunk_parts, run_by_position


def merge_levels(levels: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Levels ``[..., L, K, V]`` moved to a query further on: level ``l`` to ``max(l, m)``, ``m`` int64 ``[...]``
    broadcast over the leading dimensions (levels ``0..m`` summed into ``m``)."""
    index = torch.arange(levels.shape[-3], device=levels.device)  # [L]
    at = (index == m[..., None])[..., None, None]  # [..., L, 1, 1]
    below = (index < m[..., None])[..., None, None]
    merged = torch.cumsum(levels, dim=-3)  # [..., L, K, V]
    return torch.where(at, merged, torch.where(below, torch.zeros_like(levels), levels))


def combine_levels(left, right):
    """``(a or M, b, m)`` of two stretches in a row; ``a [...]`` a log-decay, ``M [..., K, K]`` a delta-rule
    transition, ``b [..., L, K, V]``, ``m`` int64 broadcastable to ``[...]``."""
    T1, b1, m1 = left
    T2, b2, m2 = right
    if T2.dim() == b2.dim() - 3:  # a log-decay
        T, carried = T1 + T2, torch.exp(T2)[..., None, None, None] * b1
    else:
        T, carried = T2 @ T1, torch.einsum("...ij,...ljv->...liv", T2, b1)  # M₂ M₁; M₂ S[l] for every level
    return T, merge_levels(carried, m2) + b2, torch.maximum(m1, m2)


def _levels_between(queries, before) -> list[int]:
    """``level(t, p - 1) = bit_length(t XOR (p - 1))`` on the host (0 where ``p = 0``: nothing before)."""
    return [(t ^ (p - 1)).bit_length() if p > 0 else 0 for t, p in zip(queries, before)]


def _scan_at(q, k, v, lam, g, beta, levels0, P, *, scale, C, output_final_state):
    """All sequences of the batch start at the same absolute position ``P`` (host int)."""
    dt, device = q.dtype, q.device
    B, T, H, K = q.shape
    L = lam.shape[-1]
    c = C.bit_length() - 1
    Lp = max(L, c + 1)
    r0, first = P % C, P // C
    p = chunk_parts(q, k, v, lam, g, beta, r0, scale=scale, C=C, Lp=Lp)
    N = p.qt.shape[2]
    bases = [(first + n) * C for n in range(N)]  # absolute position of each chunk's row 0
    starts = [P] + bases[1:]  # each chunk's first real token
    last_rows = [C - 1] * (N - 1) + [(r0 + T - 1) % C]  # the last chunk ends at its last real row

    # every chunk's element from a zero state
    carried = p.Kdec  # [B, H, N, C, K]: row s = (A_last ⋯ A_{s+1}) k_s β_s, one key at a time
    if beta is not None:
        carried = p.bc[..., None] * (p.Minv.transpose(-1, -2) @ carried)  # diag(β) M^{-T} K̃
    end_levels = p.lut[torch.tensor(last_rows, device=device)]  # [N, C]: level(last row, s), -1 after it
    onehot = (end_levels[..., None] == torch.arange(Lp, device=device)).to(dt)  # [N, C, Lp]
    b = torch.einsum("bhnck,bhncv,ncl->bhnlkv", carried, p.vc, onehot)  # [B, H, N, Lp, K, V]
    if beta is None:
        transition = p.log_decay  # [B, H, N]
        first_transition = transition.new_zeros(B, H, 1)
    else:
        eye = torch.eye(K, dtype=dt, device=device)
        transition = p.decay[..., None, None] * eye - p.Kdec.transpose(-1, -2) @ p.w  # [B, H, N, K, K]: exp(a) I - K̃ᵀ w
        first_transition = eye.expand(B, H, 1, K, K)
    shifts = _levels_between([base + row for base, row in zip(bases, last_rows)], starts)
    m = torch.tensor([0, *shifts], device=device)[None, None]  # [1, 1, N + 1]

    levels0 = torch.nn.functional.pad(levels0, [0, 0, 0, 0, 0, Lp - L])  # [B, H, Lp, K, V]: the view of query P - 1
    elems = (torch.cat([first_transition, transition], dim=2), torch.cat([levels0[:, :, None], b], dim=2), m.expand(B, H, -1))
    _, states, _ = associative_scan(combine_levels, elems, dim=2)  # states[:, :, n]: entering chunk n (n = N: the end)

    # every chunk's outputs: the intra block plus the entering state, key level max(l, level(t, start - 1))
    queries = [base + row for base in bases for row in range(C)]
    entering = torch.tensor(_levels_between(queries, [start for start in starts for _ in range(C)]), device=device)  # [N * C]
    index = torch.maximum(torch.arange(Lp, device=device), entering.view(N, C, 1)).clamp(max=Lp - 1)  # [N, C, Lp]
    lam_read = torch.gather(p.lamc, -1, index.expand(B, H, N, C, Lp))  # [B, H, N, C, Lp]
    reads = torch.einsum("bhnck,bhnlkv,bhncl->bhncv", p.qt, states[:, :, :N], lam_read)  # [B, H, N, C, V]
    o = heads_unchunk(p.intra + reads, r0 + T)[:, r0:]  # [B, H, N, C, V] -> [B, T, H, V]
    return o, (states[:, :, N, :L] if output_final_state else None)


def loglinear_attn_scan(q, k, v, lam, g=None, *, beta=None, scale, initial_state=None, output_final_state=False, chunk_size=64):
    """Returns ``(o [B,T,H,V], LogLinearState | None)``; ``chunk_size`` must be a power of two."""
    return run_by_position(_scan_at, q, k, v, lam, g, beta, scale, initial_state, output_final_state, chunk_size)
