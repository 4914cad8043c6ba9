"""Fused one-token decoding step of KATA with a PSD map: one read of the old state, one write of the new.

`kata_step_kernel` implements one token of `kata_recurrent` (ops/kata/recurrent.py):

    S' = exp(g) S + ψ(k) vᵀ        z' = exp(g) z + ψ(k)
    o  = S'ᵀ ψ(scale·q) / max(z'ᵀ ψ(scale·q), eps)    (normalize)    or    S'ᵀ ψ(scale·q)

ψ the PSD lift of `feature_maps.PSDFeatureMap.lift`: slot i of Mg (concat) holds the E×E outer
product `x_i x_iᵀ` of group i, the one slot of Σg (sum) `Σ_i x_i x_iᵀ`, each flattened row-major, so
feature `p = slot·E² + a·E + b` is `x[a] x[b]` of that slot. ψ is formed tile by tile in registers
and never stored.

`deltakata_step_kernel` implements one token of `deltakata_recurrent`, the gated delta rule on the
unit lifted key `ψ̂ = ψ(k) / max(‖ψ(k)‖, eps)` (ops/delta/recurrent.py's step):

    u  = exp(g) Sᵀψ̂        S' = exp(g) S + ψ̂ (β (v − u))ᵀ        o = S'ᵀ ψ(scale·q)

grid: (cdiv(V, BV), B·H). A program walks its head's P = slots·E² state rows in tiles of BR·E rows
(rows a0 .. a0 + BR of one slot's E×E block) for its BV value columns. The new state goes to new
tensors, so every program reads the old z for its normaliser while the first value tile writes the
new one: no program reads what another writes, and the step moves each state byte once each way
(ops/kata/README.md, "Decoding step"). The delta step walks the rows three times: ‖ψ(k)‖ (no
memory), u (reads S), the update and the read (reads S again, writes S').
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.kata.feature_maps import make_feature_map
from polyattn.ops.kata.state import KataState
from polyattn.ops.triton.plan import block
from polyattn.ops.triton.precision import LOG2E, dot_f32, to_output


@triton.jit
def psd_lift_tile(x, o_r, o_e, m_r, m_e, scale, slot, E, G: tl.constexpr, SUM: tl.constexpr):
    """`[BR, BE]` tile of ψ(scale·x) at rows `o_r` (a) and columns `o_e` (b) of `slot`'s E×E block;
    `x` points at one token's K = G·E features. Mg: `x_slot[a] x_slot[b]`; Σg: `Σ_i x_i[a] x_i[b]`."""
    if SUM:
        acc = tl.zeros([o_r.shape[0], o_e.shape[0]], dtype=tl.float32)
        for i in tl.static_range(G):
            x_a = tl.load(x + i * E + o_r, mask=m_r, other=0.0).to(tl.float32) * scale  # [BR]
            x_b = tl.load(x + i * E + o_e, mask=m_e, other=0.0).to(tl.float32) * scale  # [BE]
            acc += x_a[:, None] * x_b[None, :]
        return acc
    x_a = tl.load(x + slot * E + o_r, mask=m_r, other=0.0).to(tl.float32) * scale  # [BR]
    x_b = tl.load(x + slot * E + o_e, mask=m_e, other=0.0).to(tl.float32) * scale  # [BE]
    return x_a[:, None] * x_b[None, :]  # [BR, BE]


@triton.jit
def step_front(g, v, V, E, BE: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr):
    """`(i_v, i_bh64, o_e, m_e, o_v, m_v, decay, b_v)` of this program: the E×E block's column index, the
    value tile, `exp(g)` (1 without g) and the token's values `[BV]` in fp32."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_bh64 = i_bh.to(tl.int64)
    o_e = tl.arange(0, BE)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    decay = 1.0
    if USE_G:
        decay = tl.exp2(tl.load(g + i_bh).to(tl.float32) * LOG2E)
    b_v = tl.load(v + i_bh64 * V + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
    return i_v, i_bh64, o_e, o_e < E, o_v, m_v, decay, b_v


@triton.jit
def block_rows(slot, a0, o_e, m_e, o_v, m_v, E, V, BR: tl.constexpr):
    """Rows a0 .. a0 + BR of `slot`'s E×E block in one head: `(o_r, m_r, rows [BR, BE] the feature
    index p, m_p, offs [BR, BE, BV] into the head's [P, V] state, m_s)`."""
    o_r = a0 + tl.arange(0, BR)
    m_r = o_r < E
    rows = slot * E * E + o_r[:, None] * E + o_e[None, :]  # [BR, BE]
    m_p = m_r[:, None] & m_e[None, :]
    return o_r, m_r, rows, m_p, rows[:, :, None] * V + o_v[None, None, :], m_p[:, :, None] & m_v[None, None, :]


@triton.jit(do_not_specialize=["eps"])
def kata_step_kernel(
    q, k, v, g, S, z, S_new, z_new, o, scale, eps, E, V, SLOTS,
    G: tl.constexpr, SUM: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, NORMALIZE: tl.constexpr, F32: tl.constexpr,
):
    """One token for one (batch·head, value tile). q, k: [B·H, G·E]; v, o: [B·H, V]; g: [B·H] or None;
    S, S_new: [B·H, P, V] fp32; z, z_new: [B·H, P] fp32, P = SLOTS·E². No tensor-core product: F32
    only picks `to_output`'s rounding (the interpreter's)."""
    i_v, i_bh64, o_e, m_e, o_v, m_v, decay, b_v = step_front(g, v, V, E, BE, BV, USE_G)
    P = SLOTS * E * E
    S, S_new, z, z_new = S + i_bh64 * P * V, S_new + i_bh64 * P * V, z + i_bh64 * P, z_new + i_bh64 * P  # this head
    p_k, p_q = k + i_bh64 * (G * E), q + i_bh64 * (G * E)
    b_num = tl.zeros([BV], dtype=tl.float32)
    b_den = tl.zeros([BR, BE], dtype=tl.float32)
    for slot in range(0, SLOTS):
        for a0 in range(0, E, BR):
            o_r, m_r, rows, m_p, offs, m_s = block_rows(slot, a0, o_e, m_e, o_v, m_v, E, V, BR)
            psi_k = psd_lift_tile(p_k, o_r, o_e, m_r, m_e, 1.0, slot, E, G, SUM)  # [BR, BE]
            psi_q = psd_lift_tile(p_q, o_r, o_e, m_r, m_e, scale, slot, E, G, SUM)  # [BR, BE]
            b_s = tl.load(S + offs, mask=m_s, other=0.0) * decay + psi_k[:, :, None] * b_v[None, None, :]
            tl.store(S_new + offs, b_s, mask=m_s)
            b_num += tl.sum(tl.sum(psi_q[:, :, None] * b_s, axis=0), axis=0)  # [BR, BE, BV] -> [BV]
            b_z = tl.load(z + rows, mask=m_p, other=0.0) * decay + psi_k  # [BR, BE]
            if i_v == 0:  # the first value tile writes the new z
                tl.store(z_new + rows, b_z, mask=m_p)
            b_den += psi_q * b_z
    if NORMALIZE:
        b_num = b_num / tl.maximum(tl.sum(tl.sum(b_den, axis=1), axis=0), eps)
    tl.store(o + i_bh64 * V + o_v, to_output(b_num, o.dtype.element_ty, F32), mask=m_v)  # downcast: output dtype


@triton.jit(do_not_specialize=["eps"])
def deltakata_step_kernel(
    q, k, v, beta, g, S, S_new, o, scale, eps, E, V, SLOTS,
    G: tl.constexpr, SUM: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, F32: tl.constexpr,
):
    """One DeltaKATA token for one (batch·head, value tile). q, k: [B·H, G·E]; v, o: [B·H, V]; beta: [B·H];
    g: [B·H] or None; S, S_new: [B·H, P, V] fp32, P = SLOTS·E²."""
    i_v, i_bh64, o_e, m_e, o_v, m_v, decay, b_v = step_front(g, v, V, E, BE, BV, USE_G)
    P = SLOTS * E * E
    S, S_new = S + i_bh64 * P * V, S_new + i_bh64 * P * V  # this head
    p_k, p_q = k + i_bh64 * (G * E), q + i_bh64 * (G * E)
    b_beta = tl.load(beta + i_bh64).to(tl.float32)
    b_n2 = tl.zeros([BR, BE], dtype=tl.float32)
    for slot in range(0, SLOTS):  # ‖ψ(k)‖²
        for a0 in range(0, E, BR):
            o_r = a0 + tl.arange(0, BR)
            psi_k = psd_lift_tile(p_k, o_r, o_e, o_r < E, m_e, 1.0, slot, E, G, SUM)  # [BR, BE]
            b_n2 += psi_k * psi_k
    inv_norm = 1.0 / tl.maximum(tl.sqrt(tl.sum(tl.sum(b_n2, axis=1), axis=0)), eps)
    b_u = tl.zeros([BV], dtype=tl.float32)
    for slot in range(0, SLOTS):  # u = Sᵀψ̂ (of the old state; exp(g) below)
        for a0 in range(0, E, BR):
            o_r, m_r, rows, m_p, offs, m_s = block_rows(slot, a0, o_e, m_e, o_v, m_v, E, V, BR)
            psi_k = psd_lift_tile(p_k, o_r, o_e, m_r, m_e, 1.0, slot, E, G, SUM) * inv_norm
            b_u += tl.sum(tl.sum(psi_k[:, :, None] * tl.load(S + offs, mask=m_s, other=0.0), axis=0), axis=0)
    b_w = b_beta * (b_v - decay * b_u)  # [BV]: the rank-one update's value side
    b_o = tl.zeros([BV], dtype=tl.float32)
    for slot in range(0, SLOTS):  # S' = exp(g) S + ψ̂ wᵀ, o = S'ᵀψ(scale·q)
        for a0 in range(0, E, BR):
            o_r, m_r, rows, m_p, offs, m_s = block_rows(slot, a0, o_e, m_e, o_v, m_v, E, V, BR)
            psi_k = psd_lift_tile(p_k, o_r, o_e, m_r, m_e, 1.0, slot, E, G, SUM) * inv_norm
            psi_q = psd_lift_tile(p_q, o_r, o_e, m_r, m_e, scale, slot, E, G, SUM)
            b_s = tl.load(S + offs, mask=m_s, other=0.0) * decay + psi_k[:, :, None] * b_w[None, None, :]
            tl.store(S_new + offs, b_s, mask=m_s)
            b_o += tl.sum(tl.sum(psi_q[:, :, None] * b_s, axis=0), axis=0)
    tl.store(o + i_bh64 * V + o_v, to_output(b_o, o.dtype.element_ty, F32), mask=m_v)  # downcast: output dtype


def _step_plan(q, v, groups, combine):
    """`(fmap, grid, launch)` of a step: the PSD map, the (value tiles, B·H) grid and the launch arguments
    after the state pointers: E, V, slots and the tiles — the E×E block's padded width, a value tile of
    at most 32, and BR rows so that a [BR, BE, BV] fp32 tile holds at most 8,192 values (64 per thread)."""
    B, H, K = q.shape
    V = v.shape[-1]
    fmap = make_feature_map("psd", K, groups, combine)
    BE, BV = block(fmap.E), min(32, block(V))
    tiles = dict(BR=max(1, min(block(fmap.E), 8192 // (BE * BV))), BE=BE, BV=BV, G=groups, SUM=combine == "sum",
                 F32=dot_f32(q.dtype), num_warps=4)
    return fmap, (triton.cdiv(V, BV), B * H), ((fmap.E, V, fmap.slots), tiles)


def kata_step(q, k, v, g, state, *, groups, combine, normalize, eps, scale):
    """One decoding step of `kata` with a PSD map for one token per sequence.

    q, k: [B, H, K]; v: [B, H, V]; g: [B, H] log-decay or None; state: `KataState(S [B, H, P, V],
    z [B, H, P])` or None (zeros). The caller's state is not modified. Returns `(o [B, H, V] in q's
    dtype, KataState(S', z') fp32)`.
    """
    fmap, grid, (sizes, tiles) = _step_plan(q, v, groups, combine)
    if state is None:
        S = v.new_zeros(*v.shape[:2], fmap.dim(), v.shape[-1], dtype=torch.float32)  # [B, H, P, V]
        z = v.new_zeros(*v.shape[:2], fmap.dim(), dtype=torch.float32)  # [B, H, P]
    else:
        S, z = (x.to(torch.float32).contiguous() for x in state)
    S_new, z_new = torch.empty_like(S), torch.empty_like(z)
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)  # [B, H, V]
    kata_step_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), None if g is None else g.contiguous(),
        S, z, S_new, z_new, o, float(scale), float(eps), *sizes, USE_G=g is not None, NORMALIZE=normalize, **tiles,
    )
    return o, KataState(S_new, z_new)



def deltakata_step(q, k, v, beta, g, state, *, groups, combine, eps, scale):
    """One decoding step of DeltaKATA with a PSD map for one token per sequence.

    q, k: [B, H, K]; v: [B, H, V]; beta: [B, H]; g: [B, H] log-decay or None; state: `[B, H, P, V]` or
    None (zeros). The caller's state is not modified. Returns `(o [B, H, V] in q's dtype, S' fp32)`.
    """
    fmap, grid, (sizes, tiles) = _step_plan(q, v, groups, combine)
    S = v.new_zeros(*v.shape[:2], fmap.dim(), v.shape[-1], dtype=torch.float32) if state is None else state.to(torch.float32).contiguous()
    S_new = torch.empty_like(S)
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)  # [B, H, V]
    deltakata_step_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(), None if g is None else g.contiguous(),
        S, S_new, o, float(scale), float(eps), *sizes, USE_G=g is not None, **tiles,
    )
    return o, S_new


def kata_step_ref(q, k, v, g, state, *, groups, combine, normalize, eps, scale):
    """Twin of `kata_step` in float64 by the lifted features: `(o [B, H, V], KataState)`."""
    fmap = make_feature_map("psd", q.shape[-1], groups, combine)
    psi_q, psi_k = fmap.lift(scale * q.double()), fmap.lift(k.double())  # [B, H, K] -> [B, H, P]
    decay = 1.0 if g is None else torch.exp(g.double())[..., None]  # [B, H, 1]
    S0, z0 = (None, None) if state is None else (x.double() for x in state)
    S = psi_k[..., None] * v.double()[..., None, :] + (0.0 if S0 is None else decay[..., None] * S0)  # [B, H, P, V]
    z = psi_k + (0.0 if z0 is None else decay * z0)  # [B, H, P]
    num = torch.einsum("bhp,bhpv->bhv", psi_q, S)
    o = num / (psi_q * z).sum(-1, keepdim=True).clamp_min(eps) if normalize else num
    return o, KataState(S, z)


def deltakata_step_ref(q, k, v, beta, g, state, *, groups, combine, eps, scale):
    """Twin of `deltakata_step` in float64 by the lifted features: `(o [B, H, V], S')`."""
    fmap = make_feature_map("psd", q.shape[-1], groups, combine)
    psi_q, psi_k = fmap.lift(scale * q.double()), fmap.lift(k.double())  # [B, H, K] -> [B, H, P]
    unit = psi_k / torch.linalg.vector_norm(psi_k, dim=-1, keepdim=True).clamp_min(eps)  # ψ̂
    decay = 1.0 if g is None else torch.exp(g.double())[..., None, None]  # [B, H, 1, 1]
    S = decay * (torch.zeros(*psi_k.shape, v.shape[-1], dtype=torch.float64, device=q.device) if state is None else state.double())
    u = torch.einsum("bhp,bhpv->bhv", unit, S)
    S = S + unit[..., None] * (beta.double()[..., None] * (v.double() - u))[..., None, :]  # [B, H, P, V]
    return torch.einsum("bhp,bhpv->bhv", psi_q, S), S


__all__ = ["deltakata_step", "deltakata_step_kernel", "deltakata_step_ref", "kata_step", "kata_step_kernel", "kata_step_ref"]
