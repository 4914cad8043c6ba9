"""How fast can KATA-M1's quadratic forward be in Triton? A probe: a minimal kernel (no decay, no state, no
varlen, no non-finite guard, T a multiple of the tiles; normalized, G = 1) swept over tiles, warps, pipeline
stages and the score tile's precision (split in two bf16 halves, as the library's default, or rounded once,
flash attention's precision), beside the library kernel in both precisions and SDPA, in one process.

python benchmarks/kata_quadratic_probe.py OUT.json      (CUDA; bf16, H = 16, K = V = 64, 65,536 tokens per call)

Each row: ms, and `err`, the probe's max relative difference from the library kernel (split). The probe is not
used by the library; ops/kata/README.md ("Triton kernel") quotes what it measured.
"""
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

@triton.jit
def probe_tile(b_q, b_k, b_v, acc, l, o_m, o_n, MASKED: tl.constexpr, SPLIT: tl.constexpr):
    """One key tile: the squared scores (causal mask on the diagonal), the row sums, the value product."""
    s = tl.dot(b_q, tl.trans(b_k))  # [BM, D] @ [D, BN]
    a = s * s
    if MASKED:
        a = tl.where(o_m[:, None] >= o_n[None, :], a, 0.0)
    l += tl.sum(a, 1)
    if SPLIT:
        a_hi = a.to(b_v.dtype)
        a_lo = (a - a_hi.to(tl.float32)).to(b_v.dtype)
        acc += tl.dot(a_hi, b_v)
        acc += tl.dot(a_lo, b_v)
    else:
        acc += tl.dot(a.to(b_v.dtype), b_v)
    return acc, l


@triton.jit
def probe_forward(q, k, v, o, den, scale2, eps, T, H, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            SPLIT: tl.constexpr, STAGES: tl.constexpr):
    """One query tile of one (sequence, head): the off-diagonal key tiles unmasked, then the diagonal."""
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    stride = H * D
    base = (i_b * T).to(tl.int64) * stride + i_h * D
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = tl.arange(0, D)
    o_n = tl.arange(0, BN)
    b_q = tl.load(q + base + o_m[:, None] * stride + o_d[None, :])
    acc = tl.zeros([BM, D], dtype=tl.float32)
    l = tl.zeros([BM], dtype=tl.float32)
    hi = i_m * BM
    p_k = k + base + o_n[:, None] * stride + o_d[None, :]
    p_v = v + base + o_n[:, None] * stride + o_d[None, :]
    for s0 in tl.range(0, hi, BN, num_stages=STAGES):  # key tiles before the diagonal, unmasked
        acc, l = probe_tile(b_q, tl.load(p_k), tl.load(p_v), acc, l, o_m, s0 + o_n, False, SPLIT)
        p_k += BN * stride
        p_v += BN * stride
    for s0 in range(hi, hi + BM, BN):  # the diagonal, masked
        acc, l = probe_tile(b_q, tl.load(p_k), tl.load(p_v), acc, l, o_m, s0 + o_n, True, SPLIT)
        p_k += BN * stride
        p_v += BN * stride
    l = l * scale2
    out = acc * scale2 / tl.maximum(l, eps)[:, None]
    tl.store(o + base + o_m[:, None] * stride + o_d[None, :], out.to(o.dtype.element_ty))
    tl.store(den + (i_b * T + o_m) * H + i_h, l)


def run_probe(q, k, v, BM, BN, warps, stages, split):
    B, T, H, D = q.shape
    o = torch.empty_like(v)
    den = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    grid = (T // BM, B * H)
    probe_forward[grid](q, k, v, o, den, (D ** -0.5) ** 2, 1e-6, T, H, D=D, BM=BM, BN=BN, SPLIT=split, STAGES=stages,
                  num_warps=warps, num_stages=stages)
    return o


def main():
    from polyattn import ops
    from polyattn.bench.timing import bench_ms
    from polyattn.ops.triton.plan import KernelConfig, use_config
    from torch.nn.attention import sdpa_kernel, SDPBackend
    rows = []
    out = sys.argv[1] if len(sys.argv) > 1 else None
    D = 64
    H = 16
    for T in (2048, 8192):
        B = 65536 // T
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        for name, be in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
            def f(be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            rows.append(dict(T=T, impl=name, ms=bench_ms(f)))
            print(rows[-1], flush=True)
        with torch.no_grad():
            ref = ops.kata(q, k, v, impl="triton_parallel")[0]
            for mode in ("split", "rounded"):
                with use_config(KernelConfig(kata_score_dot=mode)):
                    ms = bench_ms(lambda: ops.kata(q, k, v, impl="triton_parallel"))
                rows.append(dict(T=T, impl=f"library-{mode}", ms=ms)); print(rows[-1], flush=True)
            for BM, BN, warps, stages, split in itertools.product((128, 64), (64, 128), (4, 8), (2, 3, 4), (True, False)):
                if BN > BM:
                    continue
                try:
                    o = run_probe(q, k, v, BM, BN, warps, stages, split)
                    err = ((o.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    ms = bench_ms(lambda: run_probe(q, k, v, BM, BN, warps, stages, split))
                except Exception as e:
                    ms, err = str(e)[:80], None
                rows.append(dict(T=T, impl="probe", BM=BM, BN=BN, warps=warps, stages=stages, split=split, ms=ms, err=err))
                print(rows[-1], flush=True)
    if out:
        json.dump(rows, open(out, "w"), indent=1)
    best = {}
    for r in rows:
        if isinstance(r["ms"], float):
            key = (r["T"], r["impl"], r.get("split"))
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    for key, r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[1]["ms"])):
        print(key, r)

if __name__ == "__main__":
    main()
