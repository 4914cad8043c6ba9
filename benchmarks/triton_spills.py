"""Registers and spills of the Triton kernels for Hopper, compiled on a machine without a GPU.

python benchmarks/triton_spills.py [linear guard delta levels gdn kata algebra]
Compiles the linear_attn kernels (`chunk_outputs_kernel`, `segment_states_kernel`) and the delta rule's
(`wy_kernel`, `wy_factors_kernel`, the two recurrences (the forward's with and without its outputs and stores), the per-chunk output and two gradient kernels) and log-linear
log-linear Mamba-2's `level_pass_kernel` (its three passes) and log-linear
Gated DeltaNet's (`gdn_chunk_kernel`, `gdn_levels_kernel`, `gdn_levels_chain_kernel`, `gdn_levels_grads_kernel`, the chunk gradients' three stages) and
KATA's chunked form's (`kata_states_kernel` both ways, `kata_read_kernel`, `kata_lift_grad_kernel` with and without
its read, at K = V = 64 with the default tiles) and DeltaKATA's walks and state recompute (`deltakata_walk_kernel`, `deltakata_walk_grad_kernel`, `deltakata_states_kernel`) and DeltaKATA's chunk-local kernels (`algebra`, also alone:
`deltakata_algebra_kernel`, `deltakata_algebra_grad_kernel`, `deltakata_chunk_grads_kernel`, with their compile times)
for sm_90a with the installed Triton (or the families named) and runs the ptxas that ships with it (`-v`) for several launch configurations: no device time needed.
`guard` (not in the default list) counts the floating-point instructions of linear attention's plain and guarded loops
(ops/README.md, "Guarantees of the Triton forms"); `compile` (neither) times the compile of its forward with decay on
bf16 and on fp32 inputs (ops/linear/README.md, "Triton kernels").
The installed Triton may differ from the GPU machine's, so read the numbers as indications.
"""
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from polyattn.ops.delta.triton.backward import delta_grad_factors_kernel, delta_grads_kernel, delta_score_grads_kernel, delta_state_grad_kernel
from polyattn.ops.delta.triton.forward import delta_outputs_kernel, delta_states_kernel
from polyattn.ops.delta.triton.wy import wy_factors_kernel, wy_kernel
from polyattn.ops.kata.triton.chunk import kata_lift_grad_kernel, kata_read_kernel, kata_states_kernel
from polyattn.ops.kata.triton.algebra import ALGEBRA_ROWS, SOLVE_BLOCK, deltakata_algebra_grad_kernel, deltakata_algebra_kernel
from polyattn.ops.kata.triton.delta import (
    deltakata_chunk_grads_kernel, deltakata_states_kernel, deltakata_walk_grad_kernel, deltakata_walk_kernel,
)
from polyattn.ops.kata.triton.function import feature_blocks
from polyattn.ops.linear.triton.chunk_outputs import chunk_outputs_kernel
from polyattn.ops.linear.triton.chunk_states import segment_states_kernel
from polyattn.ops.linear.triton.launch import state_rows
from polyattn.ops.loglinear.triton.gdn import gdn_chunk_kernel, gdn_levels_chain_kernel, gdn_levels_grads_kernel, gdn_levels_kernel
from polyattn.ops.loglinear.triton.level_pass import level_pass_kernel
from polyattn.ops.loglinear.triton.gdn_grads import gdn_chunk_key_grads_kernel, gdn_chunk_score_grads_kernel, gdn_chunk_value_grads_kernel
from polyattn.ops.triton.plan import KernelConfig, kata_state_chunk
from polyattn.ops.triton.precision import UPDATE_DOTS

POINTERS = {
    "a": "*bf16", "b": "*bf16", "c": "*bf16", "a2": "*bf16", "out2": "*fp32", "g": "*fp32", "out": "*bf16", "seg": "*i32", "s_in": "*fp32",
    "h0": "*fp32", "ht": "*fp32", "dot_x": "*bf16", "rowdot": "*fp32", "states": "*fp32", "seg_decay": "*fp32",
    "q": "*bf16", "k": "*bf16", "v": "*bf16", "do": "*bf16", "dq": "*bf16", "dk": "*bf16", "dv": "*bf16",
    "beta": "*bf16", "chunks": "*i32", "nonfinite": "*i32", "seqs": "*i32", "cu_chunks": "*i32", "pos": "*i64",
    "tiles": "*i32", "starts": "*i32", "bounds": "*i32", "ckpt": "*i32",
}
PASSES = {  # name: (REVERSE, USE_G, ROWDOT, UPDATE_DOT): a training forward rounds its decayed updates
    "forward": (False, False, False, UPDATE_DOTS["split"]),
    "forward, decay": (False, True, False, UPDATE_DOTS["rounded"]),
    "dk pass, decay": (True, True, True, UPDATE_DOTS["split"]),
}
DIVISIBLE = {"H", "K", "V", "DA", "DC", "P", "E"}  # int arguments a benchmark launch passes as multiples of 16
LAUNCHES = [(64, 64, 4, 2), (64, 64, 8, 2), (64, 64, 8, 3), (64, 32, 4, 2), (64, 128, 8, 2), (32, 64, 4, 2)]  # C, BC, warps, stages


def ptxas() -> Path:
    """The ptxas that Triton itself runs for sm_90a (its `get_ptxas`; the Blackwell build, which it keeps for
    sm_100 on, allocated registers differently: more spills reported for the same PTX)."""
    return Path(get_ptxas(90).path)


def compile_sm90(fn, constexprs: dict, warps: int, stages: int, pointers: dict | None = None):
    """`fn` compiled for sm_90a with the given constexprs, as a launch at the standard shape specializes it."""
    names = fn.arg_names
    scalars = {"scale": "fp32", "H": "i32", "K": "i32", "V": "i32", "N_tok": "i32", "DA": "i32", "DC": "i32", "L": "i32", "NLC": "i32", "NC": "i32", "S": "i32", "E": "i32", "P": "i32", "NE": "i32", "scale2": "fp32", "jb": "i32", "n_v": "i32"}
    pointers = POINTERS | (pointers or {})
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, scalars.get(n, "*fp32")) for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    # what a launch specializes on: 16-byte aligned pointers and sizes that are multiples of 16 (H = 16, K = V = 128)
    aligned = [i for i, n in enumerate(names) if signature[n].startswith("*") or (n in DIVISIBLE and i not in fn.do_not_specialize)]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def resources(fn, constexprs: dict, warps: int, stages: int, pointers: dict | None = None) -> str:
    kernel = compile_sm90(fn, constexprs, warps, stages, pointers)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run([ptxas(), "-arch=sm_90a", "-v", ptx, "-o", Path(tmp) / "k.cubin"],
                                capture_output=True, text=True).stderr
    regs = next(line.split("Used ")[1].split(",")[0] for line in report.splitlines() if "Used " in line)
    spill = next(line.strip() for line in report.splitlines() if "spill" in line)
    return f"{regs}; {spill}"


def main() -> None:
    warnings.filterwarnings("ignore")
    families = sys.argv[1:] or ["linear", "delta", "levels", "gdn", "kata"]
    print(f"triton {triton.__version__}, {ptxas().name}, sm_90a, bf16")
    if "linear" in families:
        linear()
    if "guard" in families:
        guarded_loop_ops()
    if "compile" in families:
        compile_times()
    if "delta" in families:
        delta_rule()
    if "levels" in families:
        loglinear_levels()
    if "gdn" in families:
        loglinear_gdn()
    if "kata" in families:
        kata_chunked()
        deltakata_chunked()
    if "kata" in families or "algebra" in families:
        deltakata_algebra()


def outputs_constexprs(**changes) -> dict:
    """`chunk_outputs_kernel`'s constexprs at K = 128: by default the forward with decay of a training call (no segment
    split, no initial or final state, split updates, bf16), with `changes` applied."""
    return dict(C=64, BA=128, R=state_rows(128), BC=64, REVERSE=False, USE_G=True, SPLIT=False, USE_H0=False, STORE_HT=False,
                ROWDOT=False, F32=False, UPDATE_DOT=UPDATE_DOTS["split"], CHECK=False, RERUN=False) | changes


def linear() -> None:
    print("linear_attn: BA = 128 (K = 128)")
    for name, (reverse, use_g, rowdot, update_dot) in PASSES.items():
        for C, BC, warps, stages in LAUNCHES:
            constexprs = outputs_constexprs(C=C, BC=BC, REVERSE=reverse, USE_G=use_g, SPLIT=True, ROWDOT=rowdot, UPDATE_DOT=update_dot,
                                            CHECK=name.startswith("forward"))
            print(f"chunk_outputs  {name:15} C{C} BC{BC} warps{warps} stages{stages}: "
                  f"{resources(chunk_outputs_kernel, constexprs, warps, stages)}", flush=True)
    for BC, warps in ((64, 4), (64, 8), (128, 4), (128, 8)):  # 128: KernelConfig.states_block_c
        constexprs = dict(C=64, BA=128, BC=BC, REVERSE=False, USE_G=True, F32=False, UPDATE_DOT=UPDATE_DOTS["rounded"], TERMINAL=True)
        print(f"segment_states decay C64 BC{BC} warps{warps}: {resources(segment_states_kernel, constexprs, warps, 2)}")


def guarded_loop_ops() -> None:
    """The floating-point instructions of `chunk_outputs_kernel`'s plain and guarded (RERUN) forward loops with
    decay: a guarded rerun's earlier outputs are bit-identical to a plain call's only if both fuse alike."""
    print("linear_attn forward with decay, C64 BA128 BC64 warps4 stages2: PTX instructions, plain / guarded loop")
    counts = []
    for rerun in (False, True):
        constexprs = outputs_constexprs(UPDATE_DOT=UPDATE_DOTS["rounded"], RERUN=rerun)
        ptx = compile_sm90(chunk_outputs_kernel, constexprs, 4, 2).asm["ptx"]
        counts.append({op: len(re.findall(rf"\b{re.escape(op)}\s", ptx)) for op in ("fma.rn.f32", "mul.f32", "sub.f32", "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16")})
    for op in counts[0]:
        print(f"  {op:55} {counts[0][op]:4d} / {counts[1][op]:4d}")


def compile_times() -> None:
    """Seconds to compile linear attention's forward with decay for sm_90a on bf16 and fp32 inputs, from an empty
    cache: Triton's front end (to PTX) and ptxas. fp32 inputs take IEEE fp32 products, which Triton emits as FMAs."""
    print("linear_attn forward with decay, C64 BA128 BC64 warps4 stages2: compile time, empty cache")
    for dtype, f32 in (("bf16", False), ("fp32", True)):
        constexprs = outputs_constexprs(F32=f32, CHECK=True)
        pointers = {n: f"*{dtype}" for n in ("a", "b", "c", "out", "dot_x")}
        kept = triton.knobs.cache.dir
        with tempfile.TemporaryDirectory() as tmp:
            triton.knobs.cache.dir = tmp
            start = time.perf_counter()
            ptx = compile_sm90(chunk_outputs_kernel, constexprs, 4, 2, pointers).asm["ptx"]
            middle = time.perf_counter()
            (Path(tmp) / "k.ptx").write_text(ptx)
            subprocess.run([ptxas(), "-arch=sm_90a", Path(tmp) / "k.ptx", "-o", Path(tmp) / "k.cubin"], check=True)
            print(f"  {dtype}: to PTX {middle - start:.1f} s ({len(ptx) // 1000} KB), ptxas {time.perf_counter() - middle:.1f} s", flush=True)
        triton.knobs.cache.dir = kept


def delta_rule() -> None:
    delta = dict(C=64, BK=128, USE_G=True, F32=False)
    print(f"wy (delta) C64 warps4: {resources(wy_kernel, delta, 4, 2)}")
    print(f"wy factors BD64 warps4: {resources(wy_factors_kernel, dict(C=64, BD=64, USE_G=True, F32=False), 4, 2)}")
    halves = dict(ys="*bf16", ys_lo="*bf16")  # Y stored as its two bf16 halves (function.y_factor)
    print(f"grad factors BD64 warps4: {resources(delta_grad_factors_kernel, dict(delta, BD=64, FP32_DOT=0), 4, 2, halves)}")
    for BV in (32, 64):
        for warps in (4, 8):
            rec = dict(delta, BV=BV, FP32_DOT=0)
            for save, out in ((True, True), (False, True), (True, False)):  # training, inference, the output kernel's walk
                walk = dict(rec, USE_H0=False, STORE_HT=True, SAVE=save, OUT=out, LEAD=0)
                print(f"delta states     BV{BV} warps{warps} save {save:d} outputs {out:d}: {resources(delta_states_kernel, walk, warps, 2)}")
            print(f"delta outputs    BV{BV} warps{warps}: {resources(delta_outputs_kernel, rec, warps, 2)}")
            print(f"delta state grad BV{BV} warps{warps}: "
                  f"{resources(delta_state_grad_kernel, dict(rec, USE_DHT=True, STORE_DH0=False, SAVE=True, LEAD=0), warps, 2, halves)}")
            print(f"delta score grads BV{BV} warps{warps}: {resources(delta_score_grads_kernel, dict(rec, BK=64), warps, 2)}")
            print(f"delta grads BK64 BV{BV} warps{warps}: {resources(delta_grads_kernel, dict(rec, BK=64), warps, 2)}")


LEVEL_PASSES = {  # name: (REVERSE, ROWDOT, DLAM, GUARD, UPDATE_DOT), as function.py launches them (a training forward rounds its adds)
    "forward": (False, False, False, True, UPDATE_DOTS["rounded"]), "dq": (False, True, True, False, UPDATE_DOTS["split"]),
    "dv, dk": (True, True, False, False, UPDATE_DOTS["split"]),
}


def loglinear_levels() -> None:
    print("log-linear Mamba-2 level_pass_kernel: BA = 128 (K = 128), C = 64, with decay")
    for name, (reverse, rowdot, dlam, guard, update_dot) in LEVEL_PASSES.items():
        for BC, warps, stages in ((64, 4, 2), (64, 8, 2), (32, 4, 2), (32, 8, 2), (64, 4, 1), (64, 8, 3)):
            constexprs = dict(C=64, LOG_C=6, BA=128, BC=BC, BL=8, BLV=8, REVERSE=reverse, USE_G=True, USE_H0=False, ROWDOT=rowdot,
                              DLAM=dlam, F32=False, GUARD=guard, UPDATE_DOT=update_dot, ATOMIC=reverse, EVEN=True)
            print(f"level pass {name:7} BC{BC} warps{warps} stages{stages}: {resources(level_pass_kernel, constexprs, warps, stages)}",
                  flush=True)


def loglinear_gdn() -> None:
    gdn = dict(C=64, LOG_C=6, BK=128, USE_G=True, F32=False, FP32_DOT=0)
    for BV in (16, 32, 64):
        for warps in (4, 8):
            print(f"log-linear GDN levels BV{BV} warps{warps}: {resources(gdn_levels_kernel, dict(gdn, BV=BV, STORE_CK=False), warps, 2)}")
            for part in (0, 1):
                print(f"log-linear GDN levels chain part {part} BV{BV} warps{warps}: "
                      f"{resources(gdn_levels_chain_kernel, dict(gdn, BV=BV, PART=part), warps, 2)}")
            print(f"log-linear GDN levels grads BV{BV} warps{warps}: {resources(gdn_levels_grads_kernel, dict(gdn, BV=BV, ATOMIC=True), warps, 2)}")
            print(f"log-linear GDN chunk  BV{BV} warps{warps}: {resources(gdn_chunk_kernel, dict(gdn, BV=BV, STORE_O=True), warps, 2)}")
            print(f"log-linear GDN chunk value grads BV{BV} warps{warps}: {resources(gdn_chunk_value_grads_kernel, dict(gdn, BK=64, BV=BV), warps, 2)}")
    keys = dict(C=64, BK=64, USE_G=True, F32=False, FP32_DOT=0)  # the chunk gradients' key-side stages: no value tile
    for warps in (4, 8):
        print(f"log-linear GDN chunk score grads BK64 warps{warps}: {resources(gdn_chunk_score_grads_kernel, dict(keys, USE_DT=False), warps, 2)}")
        print(f"log-linear GDN chunk key grads BK64 warps{warps}: {resources(gdn_chunk_key_grads_kernel, keys, warps, 2)}")


def kata_chunked() -> None:
    """KATA-M2 and M1 at K = V = 64 in the default `KernelConfig`'s tiles, warps and stages."""
    config = KernelConfig()
    BS, BT, warps, stages = config.kata_block_n, config.kata_read_block, config.kata_chunk_warps, config.kata_num_stages
    read_stages = config.kata_read_stages
    for op, groups in (("M2", 2), ("M1", 1)):
        tiling = feature_blocks(64, 64, groups, "concat", config.kata_state_block)
        shared = dict(G=groups, SUM=False, BF=tiling["BF"], BV=tiling["BV"], F32=False)
        for reverse in (False, True):
            for use_g in (False, True):
                walk = dict(shared, BE=tiling["BE"], BS=BS, SUB=kata_state_chunk(config, tiling["P"]) // BS, USE_G=use_g, USE_H0=False,
                            STORE_HT=True, REVERSE=reverse)
                print(f"kata {op} {'reverse' if reverse else 'forward'} walk{', decay' if use_g else ''}: "
                      f"{resources(kata_states_kernel, walk, warps, stages)}", flush=True)
        reads = dict(shared, BF=tiling["BR"], BT=BT)
        print(f"kata {op} read, decay: {resources(kata_read_kernel, dict(reads, USE_G=True), warps, read_stages)}")
        for read in (False, True):
            grad = dict(reads, ACCUMULATE=True, READ=read)
            print(f"kata {op} lift gradient{' + read' if read else ''}: "
                  f"{resources(kata_lift_grad_kernel, grad, warps, read_stages, dict(x='*bf16', y='*bf16'))}", flush=True)


def deltakata_chunked() -> None:
    """DeltaKATA-M2 and M1's walks and the backward's state recompute at K = V = 64 in the default chunk, a value tile
    of 32 and 16, the chunked warps."""
    config = KernelConfig()
    for op, groups in (("M2", 2), ("M1", 1)):
        for BV in (config.deltakata_block_v, 16):
            shared = dict(G=groups, SUM=False, C=config.deltakata_chunk_size, BF=64 // groups, BV=BV, F32=False)
            print(f"deltakata {op} walk BV{BV}: "
                  f"{resources(deltakata_walk_kernel, dict(shared, STORE_HS=True), config.kata_chunk_warps, 2, dict(a='*fp32', b='*fp32'))}")
            print(f"deltakata {op} reverse walk BV{BV}: "
                  f"{resources(deltakata_walk_grad_kernel, shared, config.kata_chunk_warps, 2, dict(a='*fp32'))}", flush=True)
            print(f"deltakata {op} state recompute BV{BV}: "
                  f"{resources(deltakata_states_kernel, shared, config.kata_chunk_warps, 2)}", flush=True)


def deltakata_algebra() -> None:
    """DeltaKATA-M1's chunk-local kernels (`KernelConfig.deltakata_algebra_kernels`) at K = V = 64 in the default chunk,
    8 warps as launched, each with its compile time (Triton's and ptxas' both)."""
    C = KernelConfig().deltakata_chunk_size
    fp32 = dict(a="*fp32", b="*fp32", dk="*fp32", dq="*fp32", eps="fp32")
    shared = dict(C=C, R=min(C, ALGEBRA_ROWS), BE=64, G=1, SUM=False)
    for name, fn, constexprs in (("algebra", deltakata_algebra_kernel, dict(shared, BS=SOLVE_BLOCK)),
                                 ("algebra backward", deltakata_algebra_grad_kernel, shared),
                                 ("walk's [C, C] gradients", deltakata_chunk_grads_kernel, dict(C=C, BV=32))):
        start = time.perf_counter()
        report = resources(fn, constexprs, 8, 1, fp32)
        print(f"deltakata M1 {name}: {report} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
