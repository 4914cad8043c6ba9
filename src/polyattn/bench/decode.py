"""`python -m polyattn.bench decode`: one-token decoding latency, and `generate()` throughput.

Our fused steps (linear attention and the delta rule; state [B, H, K, V] fp32 updated in place:
reads and writes 2 * 4 * B*H*K*V bytes whatever the context; log-linear Mamba-2 and Gated DeltaNet:
num_levels(T + B) such states, of which the step reads and writes those it changes: all at T = 2^k, about half
for the batch at T, ..., T + B - 1) against SDPA over a bf16 KV cache of
the given context, and fla's `fused_recurrent_simple_gla` one-token call when importable.
B = 8, H = 16, K = V = 128; KATA-M2's and DeltaKATA-M1's steps (P = 2,048 and 4,096 features, K = V = 64,
into new tensors) beside their PyTorch steps. `gbps`: the state bytes a step must move over its time;
`copy_gbps`: a device-to-device copy of the same byte count in the same process (the roofline of a step
that reads and writes its state once), and `of_copy` their ratio. Then tokens/s of `CausalLM.generate` for a small model whose
one-token calls go through the fused steps (`decode_impl="auto"`) or the PyTorch token loop
(`decode_impl="recurrent"`).
"""
from __future__ import annotations

import importlib
from pathlib import Path

import torch
import torch.nn.functional as F

from polyattn.bench.timing import device_line, try_bench, write_rows

CONTEXTS = (4096, 16384, 32768, 131072)
B, H, D = 8, 16, 128


def run(out: Path, contexts=CONTEXTS) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from polyattn.ops.delta.recurrent import delta_rule_step
    from polyattn.ops.delta.triton import delta_rule_step_inplace
    from polyattn.ops.linear.recurrent import linear_attn_step as reference_step
    from polyattn.ops.linear.triton import linear_attn_step_inplace

    print(device_line(), flush=True)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    g = -torch.rand(B, H, device="cuda", generator=gen) * 0.1
    state = torch.randn(B, H, D, D, device="cuda", generator=gen)
    state_bytes = 2 * state.numel() * 4

    copies = {}  # bytes -> GB/s of a copy that moves them

    def record(op, impl, T, ms, dim=D, moved=state_bytes):
        row = dict(op=op, impl=impl, T=T, B=B, H=H, K=dim, V=dim, mode="step", ms=ms)
        if isinstance(ms, float) and op != "decode-softmax":
            row["gbps"] = moved / ms * 1e-6
            if moved not in copies:
                copies[moved] = copy_bandwidth(moved)
            if isinstance(copies[moved], float):
                row["copy_gbps"], row["of_copy"] = copies[moved], row["gbps"] / copies[moved]
        rows.append(row)
        print(f"{op:14} {impl:32} ctx {T:>6} {ms if isinstance(ms, str) else f'{ms * 1e3:9.1f} us'}", flush=True)

    ms_step = try_bench(lambda: linear_attn_step_inplace(q, k, v, g, state, scale=D ** -0.5), rep_ms=200)
    state_ref = state.clone()
    ms_ref = try_bench(lambda: reference_step(q.float(), k.float(), v.float(), g, state_ref, scale=D ** -0.5), rep_ms=200)
    kn = F.normalize(k.float(), dim=-1).to(k.dtype)
    beta = torch.rand(B, H, device="cuda", generator=gen)
    ms_delta = try_bench(lambda: delta_rule_step_inplace(q, kn, v, beta, g, state, scale=D ** -0.5), rep_ms=200)
    ms_delta_ref = try_bench(lambda: delta_rule_step(q.float(), kn.float(), v.float(), beta, g, state_ref, scale=D ** -0.5), rep_ms=200)
    fused_gla = None
    try:
        fused_gla = importlib.import_module("fla.ops").fused_recurrent_simple_gla
    except (ImportError, AttributeError):
        pass
    if fused_gla is not None:
        q1, k1, v1, g1 = (x[:, None] for x in (q, k, v, g))  # [B, H, *] -> [B, 1, H, *]
        ms_fla = try_bench(lambda: fused_gla(q1, k1, v1, g1, initial_state=state, output_final_state=True), rep_ms=200)
    kata = kata_steps(gen)
    for T in contexts:
        for op, fused, reference, moved in kata:
            record(op, "polyattn-triton-kata-step", T, fused, KATA_D, moved)
            record(op, "polyattn-pytorch-kata-step", T, reference, KATA_D, moved)
        for op, fused, reference, moved in loglinear_steps(gen, T):
            record(op, "polyattn-triton-loglinear-step", T, fused, moved=moved)
            record(op, "polyattn-pytorch-loglinear-step", T, reference, moved=moved)
        record("decode-linear", "polyattn-triton-step", T, ms_step)
        record("decode-linear", "polyattn-pytorch-step", T, ms_ref)
        record("decode-delta", "polyattn-triton-delta-step", T, ms_delta)
        record("decode-delta", "polyattn-pytorch-delta-step", T, ms_delta_ref)
        if fused_gla is not None:
            record("decode-linear", "fla-fused_recurrent_simple_gla", T, ms_fla)
        kc, vc = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        qs = q[:, :, None]  # [B, H, D] -> [B, H, 1, D]
        for name, backend in (("sdpa-flash-kvcache", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn-kvcache", SDPBackend.CUDNN_ATTENTION)):
            def attend(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qs, kc, vc)
            record("decode-softmax", name, T, try_bench(attend, rep_ms=200))
        del kc, vc
        torch.cuda.empty_cache()
    rows += generate_throughput()
    write_rows(rows, out, "decode")
    (out / "decode.md").write_text(table(rows))
    return rows


def copy_bandwidth(moved: int) -> float | str:
    """GB/s of `dst.copy_(src)` on the GPU with `moved` bytes read and written in all (an error entry if it fails)."""
    src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = try_bench(lambda: dst.copy_(src), rep_ms=200)
    return moved / ms * 1e-6 if isinstance(ms, float) else ms


KATA_D = 64  # the KATA rows at the KATA paper's head dim: P = 2 * 32^2 (M2), 64^2 (M1) features per head


def kata_steps(gen) -> list[tuple]:
    """`[(op, ms of the fused step, ms of the PyTorch step, state bytes the step must move)]` of one token of
    KATA-M2 (decay, normalized read; S [B, H, P, V], z [B, H, P] fp32: read once, written once) and of
    DeltaKATA-M1 (decay; S read twice, written once), K = V = KATA_D."""
    from polyattn import ops
    from polyattn.ops.kata import KataState, make_feature_map
    from polyattn.ops.kata.triton.step import deltakata_step, kata_step

    q, k, v = (torch.randn(B, H, KATA_D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    g = -torch.rand(B, H, device="cuda", generator=gen) * 0.1
    beta = torch.rand(B, H, device="cuda", generator=gen)
    q1, k1, v1, g1, beta1 = (x[:, None] for x in (q, k, v, g, beta))  # [B, H, *] -> [B, 1, H, *]
    out = []
    P = make_feature_map("psd", KATA_D, 2, "concat").dim()
    state = KataState(torch.randn(B, H, P, KATA_D, device="cuda", generator=gen), torch.rand(B, H, P, device="cuda", generator=gen))
    opts = dict(groups=2, combine="concat", eps=1e-6, scale=KATA_D ** -0.5)
    fused = try_bench(lambda: kata_step(q, k, v, g, state, normalize=True, **opts), rep_ms=200)
    reference = try_bench(lambda: ops.kata(q1, k1, v1, g1, initial_state=state, output_final_state=True, impl="recurrent", **opts),
                          rep_ms=200)
    out.append(("decode-kata-m2", fused, reference, 2 * 4 * B * H * P * (KATA_D + 1)))
    P = make_feature_map("psd", KATA_D).dim()
    S = torch.randn(B, H, P, KATA_D, device="cuda", generator=gen)
    opts = dict(groups=1, combine="concat", eps=1e-6, scale=KATA_D ** -0.5)
    fused = try_bench(lambda: deltakata_step(q, k, v, beta, g, S, **opts), rep_ms=200)
    reference = try_bench(lambda: ops.kata(q1, k1, v1, g1, beta=beta1, normalize=False, initial_state=S, output_final_state=True,
                                           impl="recurrent", **opts), rep_ms=200)
    out.append(("decode-deltakata-m1", fused, reference, 3 * 4 * B * H * P * KATA_D))
    return out


def loglinear_steps(gen, T: int) -> list[tuple]:
    """`[(op, ms of the fused step, ms of the PyTorch step, state bytes the fused step moves)]` of one token
    for log-linear Mamba-2 and Gated DeltaNet with `L = num_levels(T + B)` fp32 levels [B, H, L, D, D]: every
    sequence at position T (a power of two in `CONTEXTS`: the carry reaches every level, the step's worst
    case), and ("-ragged") the batch at positions T, ..., T + B - 1. The fused step reads and writes only the
    levels it changes (ops/loglinear/triton/step.py), the PyTorch step every level."""
    from polyattn.ops.common import num_levels
    from polyattn.ops.loglinear import LogLinearState, loglinear_attn_step
    from polyattn.ops.loglinear.state import occupied_levels
    from polyattn.ops.loglinear.triton.step import loglinear_attn_step_inplace

    L = num_levels(T + B)
    q, k, v = (torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    k = F.normalize(k.float(), dim=-1).to(k.dtype)  # unit keys: the delta rule's contractive regime
    g = -torch.rand(B, H, device="cuda", generator=gen) * 0.1
    beta = torch.rand(B, H, device="cuda", generator=gen)
    lam = torch.rand(B, H, L, device="cuda", generator=gen)
    out = []
    for suffix, position in (("", torch.full((B,), T)), ("-ragged", T + torch.arange(B))):
        position = position.to("cuda")
        occupied = occupied_levels(position, L)  # [B, L]: levels with keys (the others are zero)
        levels = torch.randn(B, H, L, D, D, device="cuda", generator=gen) * occupied[:, None, :, None, None]
        state = LogLinearState(levels.clone(), position)
        touched = int(occupied.sum()) + B  # and each sequence's carry target, level ctz(t) + 1
        for op, b in (("decode-loglinear-mamba2", None), ("decode-loglinear-gdn", beta)):
            fused = try_bench(lambda b=b: loglinear_attn_step_inplace(q, k, v, lam, g, levels, position, scale=D ** -0.5, beta=b),
                              rep_ms=200)
            reference = try_bench(lambda b=b: loglinear_attn_step(q.float(), k.float(), v.float(), lam, g, b, state, scale=D ** -0.5),
                                  rep_ms=200)
            out.append((op + suffix, fused, reference, 2 * 4 * H * touched * D * D))
    return out


def generate_throughput(mixers=("gdn", "mamba2"), batch=8, prompt=512, new_tokens=128) -> list[dict]:
    """Tokens/s of greedy `generate` (bf16 autocast) for a 4-layer, width-1024 model per mixer,
    with one-token calls on the fused steps (`auto`) and on the PyTorch token loop (`recurrent`)."""
    import time

    from polyattn.models import CausalLM, LMConfig

    rows = []
    for mixer in mixers:
        for decode_impl in ("auto", "recurrent"):
            config = LMConfig(vocab_size=8192, d_model=1024, n_layers=4, mixer=mixer,
                              mixer_config=dict(num_heads=8, decode_impl=decode_impl))
            model = CausalLM(config).cuda().eval()
            ids = torch.randint(0, 8192, (batch, prompt), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model.generate(ids, 8)  # compile and warm up
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.generate(ids, new_tokens)
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            row = dict(op=f"generate-{mixer}", impl=f"decode_impl={decode_impl}", B=batch, T=prompt,
                       mode="generate", new_tokens=new_tokens, seconds=seconds, tokens_per_s=batch * new_tokens / seconds)
            rows.append(row)
            print(f"generate {mixer:7} decode_impl={decode_impl:9} {row['tokens_per_s']:10.0f} tokens/s", flush=True)
            del model
    return rows


def table(rows: list[dict]) -> str:
    gen_rows = [r for r in rows if r["mode"] == "generate"]
    rows = [r for r in rows if r["mode"] == "step"]
    contexts = sorted({r["T"] for r in rows})
    lines = [f"# decode, B={B}, H={H}, K=V={D} ({device_line()})", "",
             "| impl | " + " | ".join(f"{t // 1024}K" for t in contexts) + " |", "|---|" + "---|" * len(contexts)]
    ours = {r["T"]: r["ms"] for r in rows if r["impl"] == "polyattn-triton-step"}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        cells = []
        for t in contexts:
            r = next((r for r in rows if r["impl"] == impl and r["T"] == t), None)
            if r is None or not isinstance(r["ms"], float):
                cells.append("error" if r else "-")
                continue
            versus_linear = impl != "polyattn-triton-step" and "kata" not in r["op"]  # KATA's states are other sizes
            speed = f" ({r['ms'] / ours[t]:.1f}x ours)" if isinstance(ours.get(t), float) and versus_linear else ""
            copy = f", {r['of_copy']:.0%} of copy" if "of_copy" in r else ""
            cells.append(f"{r['ms'] * 1e3:.1f} us{speed}{copy}")
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    lines += ["", "| generate | decode | tokens/s |", "|---|---|---|"]
    lines += [f"| {r['op']} (B={r['B']}, prompt {r['T']}) | {r['impl']} | {r['tokens_per_s']:.0f} |" for r in gen_rows]
    return "\n".join(lines) + "\n"
