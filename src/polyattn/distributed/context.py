"""Context parallelism: one sequence split into contiguous shards across the ranks of a process group,
exact for every family (distributed/README.md has the math of each summary and combine).

Every rank holds the tokens ``[start_r, end_r)`` of the packed row. Per call:

1. the rank's local pass from a zero state, and its **shard summary**: the map that carries a state
   across the shard (affine in the state: a decay and a state for linear attention and KATA, ``[M | b]``
   for the delta rule and DeltaKATA, the chunk-summary element of HLA, a transition and per-level
   states for log-linear attention);
2. ONE collective: the summaries are all-gathered (the backward reduce-scatters their gradients back);
3. every rank folds the summaries of the ranks before it with the family's combine — the state that
   enters its shard — and corrects its outputs: linear attention, KATA, the delta rule and DeltaKATA
   add a read term (cheaper than a second pass), HLA and log-linear attention rerun the op from the
   incoming state (their read term is not a single product).

``cu_seqlens`` are the offsets of the documents packed in the WHOLE row, the same on every rank. A
document that starts on a later rank, or at a shard's first token, receives no state; a shard that a
document start cuts passes on only its last document's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from polyattn import ops
from polyattn.ops.common import associative_reduce, check_cu_seqlens, combine_decayed, compute_dtype, resolve_scale
from polyattn.ops.delta import DELTA_RULE_FORMS
from polyattn.ops.hla.scan import SCAN_RULES, hla_chunk_elements
from polyattn.ops.hla.variants import prepare as hla_prepare
from polyattn.ops.hla.variants import resolve_variant
from polyattn.ops.kata import make_feature_map
from polyattn.ops.kata.state import normalized_read, with_ones
from polyattn.ops.loglinear import LogLinearState, combine_levels


@dataclass(frozen=True)
class Shard:
    """One rank's tokens ``[start, end)`` of the packed row and the pieces of documents they hold (host ints)."""

    start: int
    end: int
    offsets: tuple[int, ...]  # local cu_seqlens: the document pieces inside the shard
    first_position: int  # position of the shard's first token in its document (0: a document starts there)
    last_position: int  # position of the last piece's first token in its document

    @property
    def continues(self) -> bool:
        """The first token continues a document begun on an earlier rank: it receives state."""
        return self.first_position > 0

    @property
    def passes_through(self) -> bool:
        """One document covers the whole shard and began earlier: the incoming state goes through it."""
        return self.continues and len(self.offsets) == 2

    @property
    def last_start(self) -> int:
        """Local index of the last document piece's first token."""
        return self.offsets[-2]


def shard_bounds(T: int, world_size: int) -> tuple[int, ...]:
    """Equal contiguous shards of ``T`` tokens over ``world_size`` ranks: ``(0, T/R, ..., T)``."""
    if T % world_size:
        raise ValueError(f"shard_bounds: expected a length divisible by the world size {world_size}, got {T}")
    return tuple(r * (T // world_size) for r in range(world_size + 1))


def shard_layout(bounds: Sequence[int], documents: Sequence[int] | None = None) -> tuple[Shard, ...]:
    """The shards of the token offsets ``bounds`` (``R + 1`` ints from 0) over the packed ``documents``
    offsets (the global cu_seqlens; None: one document)."""
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) < 2 or bounds[0] != 0 or any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"bounds: expected increasing token offsets from 0, one shard of >= 1 token per rank, got {list(bounds)}")
    total = bounds[-1]
    starts = [0] if documents is None else [int(c) for c in documents[:-1]]
    if documents is not None and (
        int(documents[0]) != 0 or int(documents[-1]) != total or any(b <= a for a, b in zip(documents[:-1], documents[1:]))
    ):
        raise ValueError(f"cu_seqlens: expected strictly increasing offsets from 0 to the whole row's {total} tokens, got {list(documents)}")
    shards = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        inside = [c - start for c in starts if start < c < end]
        doc_start = max(c for c in starts if c <= start)
        first = start - doc_start
        shards.append(Shard(start, end, (0, *inside, end - start), first, first if not inside else 0))
    return tuple(shards)


def _staged(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` where the backend takes it: gloo collectives run on host copies of device tensors."""
    return x.cpu() if x.device.type != "cpu" and dist.get_backend(group) == "gloo" else x


class _GatherSummaries(torch.autograd.Function):
    """All-gather ``[n] -> [R, n]``; backward: the reverse exchange, a reduce-scatter of the gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        staged = _staged(x, group).contiguous()
        out = [torch.empty_like(staged) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, staged, group=group)
        return torch.stack(out).to(x.device)  # R x [n] -> [R, n]

    @staticmethod
    def backward(ctx, grad):
        parts = list(_staged(grad, ctx.group).contiguous().unbind(0))
        mine = torch.empty_like(parts[0])
        try:
            dist.reduce_scatter(mine, parts, group=ctx.group)  # Σ over ranks of d/d(my summary)
        except RuntimeError:  # a backend without reduce-scatter (some gloo builds lack all-to-all too): an all-reduce, R x the bytes
            full = torch.stack(parts)  # [R, n]
            dist.all_reduce(full, group=ctx.group)
            mine = full[dist.get_rank(ctx.group)]
        return mine.to(grad.device), None


class _Tie(torch.autograd.Function):
    """``x`` unchanged; ``anchor`` joins x's graph with a zero gradient, so the backward reaches anchor's
    producer (a collective every rank must join) after x's on every rank."""

    @staticmethod
    def forward(ctx, x, anchor):
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.anchor
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def check_no_state(initial_state, output_final_state) -> None:
    """The shards together are one pass over the row: no state comes in or goes out."""
    if initial_state is not None or output_final_state:
        raise ValueError(
            "context parallelism: expected initial_state=None and output_final_state=False (the shards are one pass "
            f"over the whole row), got initial_state={'set' if initial_state is not None else None}, "
            f"output_final_state={output_final_state}"
        )


def apply_decayed(state, summary, shard: Shard):
    """``(a, S)`` after a state: ``exp(a) state + S`` (``combine_decayed`` with the state as left element)."""
    if not shard.passes_through:
        return summary[1]
    return combine_decayed((summary[0], state), summary)[1]


def apply_affine(state, summary, shard: Shard):
    """``[M | b]`` after a state ``[B, H, W, V]``: ``M state + b``."""
    (Mb,) = summary
    W = Mb.shape[-2]
    if not shard.passes_through:
        return Mb[..., W:]
    return Mb[..., :W] @ state + Mb[..., W:]  # [B, H, W, W] @ [B, H, W, V] -> [B, H, W, V]


def fenwick_shift(shard: Shard) -> int:
    """The level ``m`` that a shard passed through shifts earlier keys to: ``level(last, first - 1)`` in document
    positions (a key in level ``l`` of the query before the shard sits in ``max(l, m)`` of its last query)."""
    last = shard.first_position + shard.end - shard.start - 1
    return ((shard.first_position - 1) ^ last).bit_length()


class ContextParallel:
    """Context-parallel forms of the ops over the ranks of ``group`` (None: the default group).

    ``bounds``: the token offsets of every rank's shard (``R + 1`` ints, the same on every rank); None:
    equal shards of the local length. Each method takes this rank's tokens ``[B, T_r, H, D]`` (B = 1 with
    ``cu_seqlens``, the offsets of the whole packed row) and returns ``(o [B, T_r, H, V], None)`` equal to
    the single-process op on the whole row, forward and backward. No initial or final state: the shards
    together are one pass over the row. ``sent_bytes`` counts the summary bytes this rank has contributed
    to the collectives (what it receives is ``R - 1`` times as much).
    """

    def __init__(self, group=None, bounds: Sequence[int] | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("ContextParallel: expected an initialized torch.distributed process group, found none")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if bounds is not None and len(bounds) != self.world_size + 1:
            raise ValueError(f"bounds: expected {self.world_size + 1} offsets (world size + 1), got {len(bounds)}")
        self.bounds = None if bounds is None else tuple(int(b) for b in bounds)
        self.sent_bytes = 0
        self._anchor = None  # the output of the last exchange (see tie)
        self._chain = False  # inside ordered(): each exchange waits for the previous one
        self._previous = None  # the output of the last exchange

    @contextlib.contextmanager
    def ordered(self):
        """Exchanges made inside run their backward in exactly the reverse order on every rank: each one's
        input is tied to the previous one's output. For the calls of a composed op (HLA's inner-decay mixer:
        its Y and Z calls are independent), which no data dependency orders; a mixer's short-convolution
        halo is ordered by the data already (the op's summary depends on the convolved tokens)."""
        self._chain, self._previous = True, None
        try:
            yield self
        finally:
            self._chain, self._previous = False, None

    # -- layout and exchange -------------------------------------------------------------------------

    def layout(self, q: torch.Tensor, cu_seqlens: torch.Tensor | None):
        """``(every rank's Shard, this rank's Shard, local cu_seqlens or None)`` for local tokens ``q``."""
        T = q.shape[1]
        bounds = self.bounds or tuple(r * T for r in range(self.world_size + 1))
        if bounds[self.rank + 1] - bounds[self.rank] != T:
            raise ValueError(
                f"q: expected rank {self.rank}'s shard of {bounds[self.rank + 1] - bounds[self.rank]} tokens "
                f"(bounds {list(bounds)}), got T = {T}"
            )
        documents = None
        if cu_seqlens is not None:
            if q.shape[0] != 1:
                raise ValueError(f"cu_seqlens: expected B = 1 (documents packed in one row), got B = {q.shape[0]}")
            documents = cu_seqlens.tolist()  # the host needs the layout
        shards = shard_layout(bounds, documents)
        me = shards[self.rank]
        local = None
        if cu_seqlens is not None:
            local = torch.tensor(me.offsets, dtype=torch.int64, device=q.device)
            check_cu_seqlens(local, q)
        return shards, me, local

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """The collective: ``[n]`` from every rank -> ``[R, n]``, differentiable (backward: a reduce-scatter)."""
        self.sent_bytes += flat.numel() * flat.element_size()
        if self._previous is not None:
            flat = _Tie.apply(flat, self._previous)
        rows = _GatherSummaries.apply(flat, self.group)
        if self._chain:
            self._previous = rows
        self._anchor = rows
        return rows

    def tie(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` made dependent on the last exchange, so that this rank joins its reverse exchange in the
        backward even where ``x`` uses none of it (a shard that starts a document, rank 0)."""
        return _Tie.apply(x, self._anchor)

    def exchange(self, summary: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
        """Every rank's summary (tensors of one dtype) through ONE all-gather: a list over ranks."""
        flat = torch.cat([x.reshape(-1) for x in summary])  # [n]
        rows = self.gather(flat)  # [R, n]
        sizes = [x.numel() for x in summary]
        return [tuple(p.view_as(x) for p, x in zip(row.split(sizes), summary)) for row in rows.unbind(0)]

    def incoming(self, shards, summary, apply, zero):
        """The state entering this rank's shard: the fold ``state = apply(state, summary_j, shard_j)`` over the
        ranks before it, from ``zero``; None where the shard starts a document. Every rank joins the exchange.
        ``apply`` is the family's combine with the state as its left element; a shard that a document start
        cuts (``not shard_j.passes_through``) replaces the state by its own."""
        gathered = self.exchange(summary)
        if not shards[self.rank].continues:
            return None
        state = zero
        for j in range(self.rank):
            state = apply(state, gathered[j], shards[j])
        return state

    def conv_halo(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """The previous rank's last ``width`` rows of ``x [B, T_r, C]`` (zeros on rank 0), differentiable:
        the short convolution's cache across the shard boundary (one more, small, all-gather)."""
        if x.shape[1] < width:
            raise ValueError(f"x: expected shards of at least {width} tokens (the short convolution's reach), got {x.shape[1]}")
        tail = x[:, -width:]  # [B, width, C]
        rows = self.gather(tail.reshape(-1))  # [R, B * width * C]
        if self.rank == 0:
            return self.tie(torch.zeros_like(tail))
        return rows[self.rank - 1].view_as(tail)

    def context_length(self, T: int) -> int:
        """Tokens in the whole row for local shards of ``T`` tokens."""
        return self.bounds[-1] if self.bounds is not None else T * self.world_size

    # -- shared pieces -------------------------------------------------------------------------------

    @staticmethod
    def _last_piece(me: Shard, *tensors):
        """The last document piece of every per-token tensor ``[B, T_r, ...]`` (None passes through)."""
        return tuple(None if x is None else x[:, me.last_start :] for x in tensors)

    @staticmethod
    def _shard_log_decay(g, me: Shard, like: torch.Tensor) -> torch.Tensor:
        """The shard's total log-decay ``[B, H]`` (unused, zeros, where a document starts inside)."""
        B, H = like.shape[:2]
        if g is None or not me.passes_through:
            return like.new_zeros(B, H)
        return g.to(like.dtype).sum(1)

    @staticmethod
    def _local_states(state, local_cu, rows: int):
        """Initial states of the local pieces: the incoming state for the first (when it continues), zeros
        for documents that start here; ``[N_local, ...]`` with cu_seqlens, else the state or None."""
        if local_cu is None:
            return state
        n = local_cu.numel() - 1
        if state is None:
            return None
        return torch.cat([state, state.new_zeros(n - rows, *state.shape[1:])], dim=0)

    @staticmethod
    def _add_first_piece(o: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """``o [B, T_r, H, V]`` with ``extra [B, t1, H, V]`` added on the first piece's tokens."""
        t1 = extra.shape[1]
        return torch.cat([o[:, :t1] + extra.to(o.dtype), o[:, t1:]], dim=1)

    def _decayed_read(self, o, qs, g, me: Shard, state, read):
        """The incoming state's contribution to the first piece, ``exp(g_1 + … + g_t) read(q_t, state)``."""
        t1 = me.offsets[1]
        dt = state.dtype
        if g is None:
            G = torch.zeros(qs.shape[0], t1, qs.shape[2], dtype=dt, device=qs.device)  # [B, t1, H]
        else:  # the scan along the last dimension: torch's scan of a middle one over 16 heads took 2.9 ms at 8K tokens (H200)
            G = torch.cumsum(g[:, :t1].to(dt).transpose(1, 2), -1).transpose(1, 2)  # [B, t1, H]
        return self._add_first_piece(o, torch.exp(G)[..., None] * read(qs[:, :t1].to(dt), state))  # [B, t1, H, W]

    # -- the families --------------------------------------------------------------------------------

    def linear_attn(self, q, k, v, g=None, *, scale=None, cu_seqlens=None, impl="auto", initial_state=None, output_final_state=False):
        """Context-parallel :func:`polyattn.ops.linear_attn`. Summary ``(a [B,H], S [B,H,K,V])``; read correction."""
        check_no_state(initial_state, output_final_state)
        shards, me, local_cu = self.layout(q, cu_seqlens)
        scale = resolve_scale(scale, q.shape[-1])
        o, finals = ops.linear_attn(q, k, v, g, scale=scale, output_final_state=True, cu_seqlens=local_cu, impl=impl)
        S = finals[-1:] if local_cu is not None else finals  # [B, H, K, V]: the last piece's state from zero
        state = self.incoming(shards, (self._shard_log_decay(g, me, S), S), apply_decayed, torch.zeros_like(S))
        if state is None:
            return self.tie(o), None
        read = lambda qt, h: torch.einsum("bthk,bhkv->bthv", qt, h)  # noqa: E731 - [B, t, H, K] x [B, H, K, V]
        return self._decayed_read(o, q * scale, g, me, state, read), None

    def kata(
        self, q, k, v, g=None, *, feature="psd", groups=1, combine="concat", normalize=True, beta=None, eps=1e-6,
        scale=None, cu_seqlens=None, impl="auto", initial_state=None, output_final_state=False,
    ):
        """Context-parallel :func:`polyattn.ops.kata`. KATA: summary ``(a, [S | z] [B,H,P,V+1])``, read correction
        on numerator and normaliser before the division; DeltaKATA (``beta``): as :meth:`delta_rule` with P rows."""
        check_no_state(initial_state, output_final_state)
        options = dict(feature=feature, groups=groups, combine=combine, eps=eps)
        scale = resolve_scale(scale, q.shape[-1])
        if beta is not None:
            if normalize:
                raise ValueError("beta: DeltaKATA's read is unnormalized; expected normalize=False with beta, got normalize=True")
            P = make_feature_map(feature, q.shape[-1], groups, combine).dim()
            return self._affine(ops.kata, (q, k, v), dict(beta=beta, g=g, normalize=False, scale=scale, **options), P, cu_seqlens, impl)
        shards, me, local_cu = self.layout(q, cu_seqlens)
        # unnormalized on [v | 1]: the outputs are [numerator | normaliser], the state [S | z]
        out, finals = ops.kata(
            q, k, with_ones(v), g, normalize=False, scale=scale, output_final_state=True, cu_seqlens=local_cu, impl=impl, **options
        )
        Sz = finals.S[-1:] if local_cu is not None else finals.S  # [B, H, P, V + 1]
        state = self.incoming(shards, (self._shard_log_decay(g, me, Sz), Sz), apply_decayed, torch.zeros_like(Sz))
        if state is not None:
            fmap = make_feature_map(feature, q.shape[-1], groups, combine)
            read = lambda qt, h: fmap.read(qt.transpose(1, 2), h).transpose(1, 2)  # noqa: E731 - [B, t, H, K] -> [B, t, H, V + 1]
            out = self._decayed_read(out, q * scale, g, me, state, read)
        return self.tie(normalized_read(out, normalize, eps).to(q.dtype)), None

    def delta_rule(self, q, k, v, beta, g=None, *, scale=None, cu_seqlens=None, impl="auto", initial_state=None, output_final_state=False):
        """Context-parallel :func:`polyattn.ops.delta_rule`. Summary ``[M | b] [B,H,K,K+V]``; read correction."""
        check_no_state(initial_state, output_final_state)
        scale = resolve_scale(scale, q.shape[-1])
        return self._affine(ops.delta_rule, (q, k, v), dict(beta=beta, g=g, scale=scale), q.shape[-1], cu_seqlens, impl)

    def _affine(self, op, qkv, kwargs, W, cu_seqlens, impl):
        """Delta-rule families, state ``[W, V]``, transition ``S -> M S + b``. A continuing shard runs ONE pass
        on ``[0_W | v]`` from ``[I | 0]``: its outputs are ``[M_tᵀ q̃_t | o_t]`` and its final state ``[M | b]``,
        so the incoming state's read is ``(M_tᵀ q̃_t) · state`` with no second pass."""
        q, k, v = qkv
        shards, me, local_cu = self.layout(q, cu_seqlens)
        B, T, H = q.shape[:3]
        dt = compute_dtype(q)
        rows = 1 if local_cu is not None else B
        if me.continues:
            v = torch.cat([v.new_zeros(B, T, H, W), v], dim=-1)  # [B, T, H, W + V]
            eye = torch.eye(W, dtype=dt, device=q.device).expand(rows, H, W, W)
            initial = torch.cat([eye, eye.new_zeros(rows, H, W, v.shape[-1] - W)], dim=-1)  # [rows, H, W, W + V]
            initial = self._local_states(initial, local_cu, rows)
        else:
            initial = None
        out, finals = op(q, k, v, **kwargs, initial_state=initial, output_final_state=True, cu_seqlens=local_cu, impl=impl)
        Mb = finals[-1:] if local_cu is not None else finals  # [B, H, W, (W +) V]
        if not me.continues:
            Mb = torch.cat([Mb.new_zeros(*Mb.shape[:-1], W), Mb], dim=-1)  # [B, H, W, W + V]: M unused, zeros
        state = self.incoming(shards, (Mb.to(dt),), apply_affine, Mb.new_zeros(*Mb.shape[:-1], Mb.shape[-1] - W).to(dt))
        if state is None:
            return self.tie(out), None
        t1 = me.offsets[1]
        read = torch.einsum("bthw,bhwv->bthv", out[:, :t1, :, :W].to(dt), state)  # [B, t1, H, V]
        return self._add_first_piece(out[..., W:], read), None

    def hla(
        self, q, k, v, g=None, *, order=2, asymmetric=False, normalize=False, eps=1e-6, scale=None, cu_seqlens=None,
        impl="auto", initial_state=None, output_final_state=False, chunk_size=64,
    ):
        """Context-parallel :func:`polyattn.ops.hla`. Summary: the last piece's chunk elements reduced by the
        variant's combine (``(a, state fields, extras)``); the op reruns from the incoming state."""
        check_no_state(initial_state, output_final_state)
        shards, me, local_cu = self.layout(q, cu_seqlens)
        scale = resolve_scale(scale, q.shape[-1])
        rule = SCAN_RULES[resolve_variant(order, asymmetric).name]
        options = dict(order=order, asymmetric=asymmetric, normalize=normalize, scale=scale)
        variant, qp, kp, vp, gp, _, _ = hla_prepare(*self._last_piece(me, q, k, v, g), initial_state=None, **options)
        elements, _ = hla_chunk_elements(variant, qp, kp, vp, gp, chunk_size)  # [B, H, N, ...] each
        summary = associative_reduce(rule.combine, elements, dim=2)  # [B, H, ...]: the piece as one element
        fields = len(variant.calls)

        def apply(state, element, shard):
            if not shard.passes_through:
                return element[1 : 1 + fields]
            left = (torch.zeros_like(element[0]), *state, *(torch.zeros_like(x) for x in element[1 + fields :]))
            return rule.combine(left, element)[1 : 1 + fields]  # the state fields

        state = self.incoming(shards, summary, apply, tuple(torch.zeros_like(x) for x in summary[1 : 1 + fields]))
        rows = 1 if local_cu is not None else q.shape[0]
        initial = None if state is None else variant.state(*(self._local_states(x, local_cu, rows) for x in state))
        o, _ = ops.hla(
            q, k, v, g, order=order, asymmetric=asymmetric, normalize=normalize, eps=eps, scale=scale,
            initial_state=initial, cu_seqlens=local_cu, impl=impl,
        )
        return self.tie(o), None

    def loglinear_attn(self, q, k, v, lam, g=None, *, beta=None, scale=None, cu_seqlens=None, impl="auto", initial_state=None, output_final_state=False):
        """Context-parallel :func:`polyattn.ops.loglinear_attn`, levels of positions in the document. Summary: the
        last piece's levels ``b [B,H,L,K,V]`` from zero at its absolute position and the shard's transition
        (``a [B,H]``; ``M [B,H,K,K]`` with beta); combine ``merge_m(transition(levels)) + b``; the op reruns."""
        check_no_state(initial_state, output_final_state)
        shards, me, local_cu = self.layout(q, cu_seqlens)
        scale = resolve_scale(scale, q.shape[-1])
        B, T, H, K = q.shape
        V, L = v.shape[-1], lam.shape[-1]
        dt = compute_dtype(q)
        empty = torch.zeros(B, H, L, K, V, dtype=dt, device=q.device)
        at = torch.full((B,), me.last_position, dtype=torch.int64, device=q.device)
        piece = self._last_piece(me, q, k, v, lam, g, beta)
        _, final = ops.loglinear_attn(
            *piece[:5], beta=piece[5], scale=scale, initial_state=LogLinearState(empty, at), output_final_state=True, impl=impl
        )
        if beta is None:
            transition = self._shard_log_decay(g, me, final.levels)  # [B, H]
        elif me.passes_through:  # M = A_T ... A_1: the delta rule's final state from I on zero values
            eye = torch.eye(K, dtype=dt, device=q.device).expand(B, H, K, K)
            delta_impl = impl if impl in DELTA_RULE_FORMS else "auto"  # log-linear's "scan": the delta rule has none
            _, transition = ops.delta_rule(
                q, k, q.new_zeros(B, T, H, K), beta, g, scale=scale, initial_state=eye, output_final_state=True, impl=delta_impl
            )  # [B, H, K, K]
        else:
            transition = empty.new_zeros(B, H, K, K)  # unused: a document starts inside

        def apply(levels, summary, shard):
            transition, b = summary
            if not shard.passes_through:
                return b
            m = torch.tensor(fenwick_shift(shard), device=levels.device)
            return combine_levels((torch.zeros_like(transition), levels, m), (transition, b, m))[1]  # merge_m(T h) + b

        state = self.incoming(shards, (transition.to(dt), final.levels.to(dt)), apply, empty)
        if state is None:
            initial = None
        else:
            rows = 1 if local_cu is not None else B
            position = torch.full((rows,), me.first_position, dtype=torch.int64, device=q.device)
            initial = LogLinearState(
                self._local_states(state, local_cu, rows), self._local_states(position, local_cu, rows)
            )
        o, _ = ops.loglinear_attn(q, k, v, lam, g, beta=beta, scale=scale, initial_state=initial, cu_seqlens=local_cu, impl=impl)
        return self.tie(o), None


def enable_context_parallel(model: torch.nn.Module, group=None, bounds: Sequence[int] | None = None) -> torch.nn.Module:
    """Switch every mixer of ``model`` to context parallelism over ``group`` (None: the default group; use a
    group of its own when data parallelism shares the ranks). Each rank then feeds its shard
    ``[B, T_r]`` of the sequence (``bounds`` as :class:`ContextParallel`; ``cu_seqlens``: the whole row's
    offsets) and gets exactly its part of the single-process result, forward and backward. ``group=False``
    switches it off again. Raises ValueError for a mixer without a chunk summary (softmax)."""
    from polyattn.layers import Mixer

    mixers = [m for m in model.modules() if isinstance(m, Mixer)]
    if group is False:
        for m in mixers:
            m.context_parallel = None
        return model
    unsupported = sorted({m.name for m in mixers if not m.supports_context_parallel})
    if unsupported:
        raise ValueError(f"enable_context_parallel: mixers {unsupported} have no chunk summary to exchange (softmax needs ring attention)")
    for m in mixers:
        m.context_parallel = ContextParallel(group, bounds)
    return model
