"""Every Triton kernel that the Triton forms launch compiles for Hopper (sm_90), checked without a GPU.

The interpreter runs a kernel's Python on NumPy and skips what only the GPU compiler checks: a tensor-core
product needs every dimension at least 16, for one. A kernel can pass every interpreted test and still fail
to compile on the GPU (the chunked KATA reads did, at a group width of 8). Here each family's Triton form runs
forward and backward, and one decoding token, at small shapes in bf16 and fp32 while every launch is recorded
(kernel, argument types, constexprs, warps and stages) and not interpreted: which kernels launch, and with what,
is decided on the host from shapes and configs alone (the forms never read a result back to choose), and the
other tests interpret the kernels. A process without the interpreter then lowers each distinct launch through
Triton's front end and its GPU passes for sm_90, the bf16 launches on the tensor-core branch the interpreter
never takes (`polyattn.ops.triton.launches`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from polyattn.ops.triton.launches import recording

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def run_forms(dtype: torch.dtype) -> None:
    """Every Triton form once forward and backward (with a final state) and for one decoding token from it."""
    from polyattn import ops
    from polyattn.ops.common import num_levels
    from polyattn.testing import seeded_inputs

    T, H, K, V = 70, 2, 16, 12
    x = seeded_inputs(2, T, H, K, V, decay=True, beta=True, seed=3, device="cpu")
    q, k, v = (x[n].to(dtype) for n in ("q", "k", "v"))
    g, beta = x["g"].float(), x["beta"].to(dtype)
    unit_k = torch.nn.functional.normalize(k.float(), dim=-1).to(dtype)
    lam = torch.rand(2, T, H, num_levels(T), generator=torch.Generator().manual_seed(4)).to(dtype)
    forms = {
        "linear_attn": lambda q, k, v, t, **kw: ops.linear_attn(q, k, v, g[:, t], impl="triton", **kw),
        "delta_rule": lambda q, k, v, t, **kw: ops.delta_rule(q, unit_k[:, t], v, beta[:, t], g[:, t], impl="triton", **kw),
        "hla2": lambda q, k, v, t, **kw: ops.hla(q, k, v, g[:, t], impl="triton", **kw),
        "hla3": lambda q, k, v, t, **kw: ops.hla(q, k, v, g[:, t], order=3, impl="triton", **kw),
        "ahla": lambda q, k, v, t, **kw: ops.hla(q, k, v, g[:, t], asymmetric=True, impl="triton", **kw),
        "loglinear_mamba2": lambda q, k, v, t, **kw: ops.loglinear_attn(q, k, v, lam[:, t], g[:, t], impl="triton", **kw),
        "loglinear_gdn": lambda q, k, v, t, **kw: ops.loglinear_attn(q, unit_k[:, t], v, lam[:, t], g[:, t], beta=beta[:, t],
                                                                    impl="triton", **kw),
        "kata_m1": lambda q, k, v, t, **kw: ops.kata(q, k, v, g[:, t], impl="triton", **kw),
        "kata_m2": lambda q, k, v, t, **kw: ops.kata(q, k, v, g[:, t], groups=2, impl="triton", **kw),
        "kata_m2_chunk": lambda q, k, v, t, **kw: ops.kata(q, k, v, g[:, t], groups=2, impl="triton_chunk", **kw),
        "kata_s2_chunk": lambda q, k, v, t, **kw: ops.kata(q, k, v, g[:, t], groups=2, combine="sum", impl="triton_chunk", **kw),
        "kata_lorentz": lambda q, k, v, t, **kw: ops.kata(q, k, v, g[:, t], feature="lorentz", impl="triton", **kw),
        "deltakata_lorentz": lambda q, k, v, t, **kw: ops.kata(q, k, v, g[:, t], feature="lorentz", beta=beta[:, t], normalize=False,
                                                              impl="triton", **kw),
        "deltakata_m1_chunk": lambda q, k, v, t, **kw: ops.kata(q, k, v, g[:, t], beta=beta[:, t], normalize=False,
                                                               impl="triton_chunk", **kw),
    }
    whole, last = slice(0, T - 1), slice(T - 1, T)
    for name, form in forms.items():
        leaves = [t[:, whole].clone().requires_grad_() for t in (q, k, v)]
        o, state = form(*leaves, whole, output_final_state=True)
        torch.autograd.grad(o.float().square().sum(), leaves, allow_unused=True)
        with torch.no_grad():
            form(q[:, last], k[:, last], v[:, last], last, initial_state=state)


def all_kernels() -> set:
    """`(module, name)` of every kernel (a jitted function named `*_kernel`) in the package."""
    import importlib
    import pkgutil

    import polyattn

    found = set()
    for info in pkgutil.walk_packages(polyattn.__path__, "polyattn."):
        if ".triton" in info.name:
            module = importlib.import_module(info.name)
            found |= {(fn.fn.__module__, name) for name, fn in vars(module).items()
                      if name.endswith("_kernel") and hasattr(fn, "fn") and fn.fn.__module__.startswith("polyattn.")}
    return found


@pytest.mark.skipif(not INTERPRETING, reason="on a GPU every test compiles the kernels it launches for the GPU itself")
def test_every_launched_kernel_compiles_for_hopper(tmp_path):
    from polyattn.ops.triton.plan import KernelConfig, use_config

    small = KernelConfig(kata_block_m=32, kata_block_n=16, kata_chunk_size=64, kata_read_block=32)
    split = replace(small, split_fill=1e9, min_segment_chunks=1, delta_fused_outputs=False, delta_split_fill=1e9,
                    delta_split_backward=True, deltakata_chunk_size=16, deltakata_state_interval=2,
                    deltakata_algebra_kernels=True)  # the other paths
    with recording(execute=False) as launches:
        for config, dtypes in ((small, (torch.bfloat16, torch.float32)), (split, (torch.bfloat16,))):
            with use_config(config):
                for dtype in dtypes:
                    run_forms(dtype)
    missing = all_kernels() - {(x["module"], x["name"]) for x in launches}
    assert not missing, f"kernels no form launched here: {sorted(missing)}"
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches))
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "polyattn.ops.triton.launches", str(path)], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert f"{len(launches)} of {len(launches)} launches lowered" in done.stdout, done.stdout[-2000:]
