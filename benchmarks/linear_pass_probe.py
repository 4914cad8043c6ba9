"""Where a linear-attention pass with decay spends its time: variants of one pass timed side by side.

python benchmarks/linear_pass_probe.py [--T 8192] [--groups layout tiles] [--out FILE.json]
Times `chunk_pass` (launch.py) for each pass of a fwd+bwd with and without decay, then a probe copy of its
loop (`probe_outputs_kernel`: no guard, no segment split, no initial state) with switches:
    ORDER 0: intra product into a fresh accumulator, inter `a @ S` beside it, summed (the library's order);
          1: inter first into the accumulator, the intra products accumulated into it (one [C, BC] fp32 tile live).
    BSIDE 0: the update's decay on the values (right operand split, the library's); 1: on the keys (left split).
    LATE  0: the rowdot operand loaded with the others (the library's); 1: loaded where it is used;
          2: loaded a chunk ahead, at the end of the previous chunk.
    PRE   0: the chunk's log-decay cumsum in the kernel (the library's); 1: read from `chunk_cumsum`, computed once.
    HALVES 1: the `[BA, BC]` state held as two `[BA / 2, BC]` tiles, a and b loaded as two column halves each, so
          a state tile is split for the tensor cores half at a time (fewer live registers).
and the value tile, warps and stages, at the standard shape (bf16, H = 16, K = V = 128, 65,536 tokens). Each
variant's output is compared with the first variant of its kind (pass, decay, update, rowdot) before it is timed.
ops/linear/README.md ("Where the decay's time goes") has the results.
"""
import argparse
import json

import torch
import triton
import triton.language as tl

from polyattn.ops.linear.triton.launch import chunk_pass
from polyattn.ops.triton.decay import chunk_decay, chunk_segsum, chunk_side_decays
from polyattn.ops.triton.plan import block, chunk_tokens, segment_table, state_tile
from polyattn.ops.triton.precision import dot_f32, mma, mma_acc, mma_left_acc, mma_left_fp32, mma_right_acc, mma_right_fp32, to_output


@triton.jit
def probe_outputs_kernel(
    a, b, c, g, gcum, out, seg, dot_x, rowdot, scale, N_tok, H, DA, DC,
    C: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr, REVERSE: tl.constexpr, USE_G: tl.constexpr,
    ROWDOT: tl.constexpr, F32: tl.constexpr, UPDATE_DOT: tl.constexpr, ORDER: tl.constexpr, BSIDE: tl.constexpr, LATE: tl.constexpr,
    PRE: tl.constexpr, HALVES: tl.constexpr,
):
    i_c, i_s, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(seg + i_s * 4).to(tl.int64)
    eos = tl.load(seg + i_s * 4 + 1).to(tl.int64)
    o_a, o_c, m_a, m_c, m_s = state_tile(i_c, DA, DC, BA, BC)
    b_s = tl.zeros([BA, BC], dtype=tl.float32)
    if HALVES:  # the state as two [BA / 2, BC] tiles (rows of a and b split alike)
        o_h = tl.arange(0, BA // 2)
        b_s0 = tl.zeros([BA // 2, BC], dtype=tl.float32)
        b_s1 = tl.zeros([BA // 2, BC], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    if ROWDOT and LATE == 2:  # the first chunk's rowdot operand, then each next one at the end of the loop body
        t0, m0 = chunk_tokens(bos, eos, 0, n_chunks, C, REVERSE)  # [C]
        b_x = tl.load(dot_x + (t0 * H + i_h)[:, None] * DC + o_c[None, :], mask=m0[:, None] & m_c[None, :], other=0.0)
    for i in range(0, n_chunks):
        t, m_t = chunk_tokens(bos, eos, i, n_chunks, C, REVERSE)  # [C]
        row_a = (t * H + i_h)[:, None] * DA + o_a[None, :]  # [C, BA]
        row_c = (t * H + i_h)[:, None] * DC + o_c[None, :]  # [C, BC]
        m_ta = m_t[:, None] & m_a[None, :]
        m_tc = m_t[:, None] & m_c[None, :]
        if HALVES:
            row_h = (t * H + i_h)[:, None] * DA + o_h[None, :]  # [C, BA / 2]
            m_th = m_t[:, None] & (o_h < DA)[None, :]
            b_a0 = tl.load(a + row_h, mask=m_th, other=0.0)  # [C, BA / 2]
            b_a1 = tl.load(a + row_h + BA // 2, mask=m_th, other=0.0)  # [C, BA / 2]
            b_b0 = tl.load(b + row_h, mask=m_th, other=0.0)  # [C, BA / 2]
            b_b1 = tl.load(b + row_h + BA // 2, mask=m_th, other=0.0)  # [C, BA / 2]
        else:
            b_a = tl.load(a + row_a, mask=m_ta, other=0.0)  # [C, BA]
            b_b = tl.load(b + row_a, mask=m_ta, other=0.0)  # [C, BA]
        b_v = tl.load(c + row_c, mask=m_tc, other=0.0)  # [C, BC]
        if ROWDOT and LATE == 0:
            b_x = tl.load(dot_x + row_c, mask=m_tc, other=0.0)  # [C, BC]
        if PRE and USE_G:  # the chunk-local log2 cumsum computed once for every pass
            t_end = tl.minimum(tl.max(t, axis=0) + 1, eos)
            b_last = tl.load(gcum + (t_end - 1) * H + i_h)
            b_gc = tl.where(m_t, tl.load(gcum + t * H + i_h, mask=m_t, other=0.0), b_last)
            b_g = b_gc
        else:
            b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
        b_wq, b_wk = chunk_side_decays(b_g, b_gc, b_last, REVERSE, F32 and not PRE)  # [C], [C]
        b_wa = tl.exp2(b_wq) * scale  # [C]
        b_d = chunk_segsum(b_g, b_gc, b_last, REVERSE, F32 and not PRE)  # [C, C]
        if HALVES:
            b_att = mma_acc(b_a1, tl.trans(b_b1), mma(b_a0, tl.trans(b_b0), F32), F32)  # [C, C]
            b_att = b_att * (tl.exp2(b_d) * scale)  # [C, C]
            b_o = mma_left_fp32(b_att, b_v, F32)  # [C, BC]
            b_in = mma_right_acc(b_a0, b_s0, tl.zeros([C, BC], dtype=tl.float32), F32, 0)  # [C, BC]
            b_o += mma_right_acc(b_a1, b_s1, b_in, F32, 0) * b_wa[:, None]  # [C, BC]
            if USE_G:
                b_vd = b_v.to(tl.float32) * tl.exp2(b_wk)[:, None]  # [C, BC]
                b_s0 = mma_right_acc(tl.trans(b_b0), b_vd, b_s0 * tl.exp2(b_last), F32, UPDATE_DOT)
                b_s1 = mma_right_acc(tl.trans(b_b1), b_vd, b_s1 * tl.exp2(b_last), F32, UPDATE_DOT)
            else:
                b_s0 = mma_acc(tl.trans(b_b0), b_v, b_s0, F32)
                b_s1 = mma_acc(tl.trans(b_b1), b_v, b_s1, F32)
        elif ORDER == 0:
            b_att = mma(b_a, tl.trans(b_b), F32)  # [C, C]
            b_att = b_att * (tl.exp2(b_d) * scale)  # [C, C]
            b_o = mma_left_fp32(b_att, b_v, F32)  # [C, BC]
            b_o += mma_right_fp32(b_a, b_s, F32) * b_wa[:, None]  # [C, BC]
        else:
            b_att = mma(b_a, tl.trans(b_b), F32)  # [C, C]
            b_att = b_att * (tl.exp2(b_d) * scale)  # [C, C]
            b_o = mma_right_fp32(b_a, b_s, F32) * b_wa[:, None]  # [C, BC]
            b_o = mma_left_acc(b_att, b_v, b_o, F32)  # [C, BC]
        if not HALVES:
            b_s = b_s * tl.exp2(b_last)
            if not USE_G:
                b_s = mma_acc(tl.trans(b_b), b_v, b_s, F32)
            elif BSIDE == 0:
                b_s = mma_right_acc(tl.trans(b_b), b_v.to(tl.float32) * tl.exp2(b_wk)[:, None], b_s, F32, UPDATE_DOT)
            else:
                b_s = mma_left_acc(tl.trans(b_b.to(tl.float32) * tl.exp2(b_wk)[:, None]), b_v, b_s, F32)
        tl.store(out + row_c, to_output(b_o, out.dtype.element_ty, F32), mask=m_tc)
        if ROWDOT:
            if LATE == 1:
                b_x = tl.load(dot_x + row_c, mask=m_tc, other=0.0)  # [C, BC]
            tl.store(rowdot + (i_c * N_tok + t) * H + i_h, tl.sum(b_x.to(tl.float32) * b_o, axis=1), mask=m_t)
            if LATE == 2:
                if REVERSE:
                    t1 = t - C
                else:
                    t1 = t + C
                m1 = (t1 >= bos) & (t1 < eos)
                b_x = tl.load(dot_x + (t1 * H + i_h)[:, None] * DC + o_c[None, :], mask=m1[:, None] & m_c[None, :], other=0.0)


def chunk_cumsum(g, seq_lens, C=64):
    """[N_tok, H] fp32: the inclusive cumsum of g (raised to the reset limit) inside each chunk of C tokens of each
    sequence, times log2(e)."""
    out, start = [], 0
    for n in seq_lens:
        x = g[start:start + n].float().clamp(min=-110.0)
        pad = (-n) % C
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(-1, C, g.shape[1]).cumsum(1).view(-1, g.shape[1])[:n]
        out.append(x * 1.4426950408889634)
        start += n
    return torch.cat(out).contiguous()


def probe_pass(a, b, c, g, seq_lens, *, reverse, dot_x, update_dot, order, bside, late, warps, stages, block_c=64, gcum=None,
               halves=False):
    N_tok, H, DA = a.shape
    DC = c.shape[-1]
    BA, BC = block(DA), min(block(DC), block_c)
    seg, _, S = segment_table(seq_lens, 1, 64, a.device)
    out = torch.empty_like(c)
    rowdot = torch.empty(triton.cdiv(DC, BC), N_tok, H, dtype=torch.float32, device=a.device) if dot_x is not None else None
    probe_outputs_kernel[(triton.cdiv(DC, BC), S, H)](
        a, b, c, g, gcum, out, seg, dot_x, rowdot, 0.08, N_tok, H, DA, DC,
        C=64, BA=BA, BC=BC, REVERSE=reverse, USE_G=g is not None, ROWDOT=dot_x is not None, F32=dot_f32(a.dtype), UPDATE_DOT=update_dot,
        ORDER=order, BSIDE=bside, LATE=late, PRE=gcum is not None, HALVES=halves, num_warps=warps, num_stages=stages,
    )
    return out, rowdot


# (reverse, decay, rowdot, UPDATE_DOT, ORDER, BSIDE, LATE, PRE, block_c, warps, stages[, HALVES]); UPDATE_DOT 0 split, 2 rounded
GROUPS = {
    "layout": [  # the products' order and operands, the rowdot's load, warps and stages (call 32)
        (True, False, False, 0, 0, 0, 0, 0, 64, 4, 2), (True, True, False, 0, 0, 0, 0, 0, 64, 4, 2),
        (True, True, False, 2, 0, 0, 0, 0, 64, 4, 2), (True, True, True, 0, 0, 0, 0, 0, 64, 4, 2),
        (True, True, True, 0, 0, 0, 1, 0, 64, 4, 2), (True, True, False, 0, 1, 0, 0, 0, 64, 4, 2),
        (True, True, False, 0, 0, 1, 0, 0, 64, 4, 2), (True, True, False, 0, 1, 1, 0, 0, 64, 4, 2),
        (True, True, True, 0, 1, 0, 0, 0, 64, 4, 2), (True, True, True, 0, 1, 1, 1, 0, 64, 4, 2),
        (True, True, True, 0, 1, 0, 1, 0, 64, 4, 2), (True, False, False, 0, 1, 0, 0, 0, 64, 4, 2),
        (True, True, True, 0, 1, 0, 0, 0, 64, 8, 2), (True, True, True, 0, 1, 0, 0, 0, 64, 4, 1),
        (False, True, True, 0, 0, 0, 0, 0, 64, 4, 2), (False, True, True, 0, 1, 0, 0, 0, 64, 4, 2),
        (False, True, False, 2, 0, 0, 0, 0, 64, 4, 2), (False, True, False, 2, 1, 0, 0, 0, 64, 4, 2),
        (False, False, False, 0, 0, 0, 0, 0, 64, 4, 2), (False, False, False, 0, 1, 0, 0, 0, 64, 4, 2),
    ],
    "tiles": [  # 32-column tiles, the rowdot prefetched a chunk ahead, the cumsum precomputed (call 33)
        (True, False, False, 0, 0, 0, 0, 0, 64, 4, 2), (True, False, False, 0, 0, 0, 0, 0, 32, 4, 2),
        (True, True, False, 0, 0, 0, 0, 0, 32, 4, 2), (True, True, True, 0, 0, 0, 0, 0, 32, 4, 2),
        (True, True, True, 0, 0, 0, 2, 0, 32, 4, 2), (False, True, False, 2, 0, 0, 0, 0, 32, 4, 2),
        (True, False, True, 0, 0, 0, 0, 0, 64, 4, 2), (True, False, True, 0, 0, 0, 2, 0, 64, 4, 2),
        (True, True, False, 0, 0, 0, 0, 0, 64, 4, 2), (True, True, False, 0, 0, 0, 0, 1, 64, 4, 2),
        (True, True, True, 0, 0, 0, 0, 0, 64, 4, 2), (True, True, True, 0, 0, 0, 2, 0, 64, 4, 2),
        (True, True, True, 0, 0, 0, 2, 1, 64, 4, 2), (False, True, True, 0, 0, 0, 0, 0, 64, 4, 2),
        (False, True, True, 0, 0, 0, 2, 1, 64, 4, 2), (False, True, False, 2, 0, 0, 0, 0, 64, 4, 2),
        (False, True, False, 2, 0, 0, 0, 1, 64, 4, 2),
    ],
    "halves": [  # the state as two row halves (HALVES), each beside its baseline
        (True, False, False, 0, 0, 0, 0, 0, 64, 4, 2), (True, False, False, 0, 0, 0, 0, 0, 64, 4, 2, 1),
        (True, True, False, 0, 0, 0, 0, 0, 64, 4, 2), (True, True, False, 0, 0, 0, 0, 0, 64, 4, 2, 1),
        (True, True, True, 0, 0, 0, 0, 0, 64, 4, 2), (True, True, True, 0, 0, 0, 0, 0, 64, 4, 2, 1),
        (False, True, False, 2, 0, 0, 0, 0, 64, 4, 2), (False, True, False, 2, 0, 0, 0, 0, 64, 4, 2, 1),
        (False, True, True, 0, 0, 0, 0, 0, 64, 4, 2), (False, True, True, 0, 0, 0, 0, 0, 64, 4, 2, 1),
        (True, True, True, 0, 0, 0, 0, 0, 64, 8, 2, 1),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--out", default=None)
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    args = parser.parse_args()
    H, D, T = 16, 128, args.T
    B = 65536 // T
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B * T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    g = -torch.rand(B * T, H, device="cuda") * 0.1
    lens = (T,) * B
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)  # noqa: E731
    rows = {}
    library = {  # name: chunk_pass arguments of each pass of a fwd+bwd
        "fwd": dict(a=q, b=k, c=v, reverse=False, guard=True, rounded_updates=True),
        "dq": dict(a=do, b=v, c=k, reverse=False, dot_x=q),
        "dv": dict(a=k, b=q, c=do, reverse=True),
        "dk": dict(a=v, b=do, c=q, reverse=True, dot_x=k),
    }
    for name, kw in library.items():
        for decay in (False, True):
            kw_g = dict(kw, g=g if decay else None)
            if not decay:
                kw_g.pop("dot_x", None)
            rows[f"library {name}{' decay' if decay else ''}"] = bench(lambda: chunk_pass(seq_lens=lens, scale=0.08, **kw_g))
    variants = [v for group in args.groups for v in GROUPS[group]]
    gcum = chunk_cumsum(g, lens)
    ref = {}
    for rev, decay, rd, ud, order, bside, late, pre, bc, warps, stages, *halves in variants:
        halves = bool(halves and halves[0])
        name = (f"probe {'anti' if rev else 'causal'}{' decay' if decay else ''}{' rowdot' if rd else ''}"
                f" update{ud} order{order} bside{bside} late{late} pre{pre} bc{bc} w{warps} s{stages}{' halves' if halves else ''}")
        kw = dict(reverse=rev, dot_x=k if rd else None, update_dot=ud, order=order, bside=bside, late=late, warps=warps, stages=stages,
                  gcum=gcum if pre else None, block_c=bc, halves=halves)
        try:
            out, rdot = probe_pass(v, do, q, g if decay else None, lens, **kw)
            key = (rev, decay, ud, rd)
            ref.setdefault(key, (out.float(), rdot))
            err = ((out.float() - ref[key][0]).norm() / ref[key][0].norm()).item()
            if rdot is not None and ref[key][1] is not None:
                err = max(err, ((rdot - ref[key][1]).norm() / ref[key][1].norm()).item())
            rows[name] = bench(lambda: probe_pass(v, do, q, g if decay else None, lens, **kw))
            print(f"{name}: {rows[name]:.3f} ms (rel. diff from the first of its kind {err:.1e})", flush=True)
        except Exception as exc:  # a variant that does not compile is reported, not fatal
            print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    for name, ms in rows.items():
        if name.startswith("library"):
            print(f"{name}: {ms:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"T": T, "B": B, "H": H, "D": D, "ms": rows, "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
