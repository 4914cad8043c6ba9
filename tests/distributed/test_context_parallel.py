"""Context parallelism on the gloo backend, 2 and 4 processes spawned here (each job bounded in time):
outputs and gradients on every shard == the single-process op on the whole row in float64, for every
family, over splits that cut a chunk, sit on a Fenwick level boundary (64) and cut packed documents;
the bytes each rank contributes to the collective == the stated summary size; a model switched by
``enable_context_parallel`` == the same model in one process (logits and summed parameter gradients);
``benchmarks/context_parallel_run.py`` under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cp_cases import CASES, case_call, reference, row

from polyattn.distributed import ContextParallel, enable_context_parallel, shard_bounds, shard_layout
from polyattn.models import CausalLM, LMConfig
from polyattn.ops.common import num_levels
from polyattn.testing import LOW_PRECISION_CEILING, LOW_PRECISION_FLOOR, rel_err, run_ranks

TOL = 1e-10
H, K, V = 2, 4, 3

# (bounds, global cu_seqlens): a split inside chunk 64..127; a split at the level boundary 64 with a document
# across it; four ranks where documents start inside a shard, at a shard's first token, and span three shards
LAYOUTS = {
    2: [((0, 70, 150), None), ((0, 64, 150), (0, 20, 100, 150)), (None, None)],
    4: [((0, 50, 64, 129, 160), (0, 30, 64, 100, 160)), ((0, 50, 64, 129, 160), (0, 30, 140, 160))],
}


def summary_numel(name, H, K, V, L):
    """Per rank and call: the summary entries the all-gather carries (distributed/README.md, "Collective volume")."""
    _, _, options, _ = CASES[name]
    Vn = V + 1 if options.get("normalize") and name.startswith(("hla", "ahla")) else V
    P = {"psd": K * K, "orthant": K, "lorentz": K}[options.get("feature", "psd")]
    if options.get("combine") == "sum":
        P = (K // 2) ** 2
    elif options.get("groups", 1) == 2:
        P = 2 * (K // 2) ** 2
    per_head = {
        "linear_attn": K * V + 1,
        "delta_rule": K * K + K * V,
        "loglinear_attn": L * K * V + (K * K if "beta" in options else 1),
        "kata": P * P + P * V if "beta" in options else P * (V + 1) + 1,
    }.get(CASES[name][0])
    if per_head is None:  # hla: (a, state fields, extras)
        per_head = 1 + (3 * K * K + 3 * K * Vn if options.get("order") == 3 else K * K + 2 * K * Vn)
    return H * per_head


def _ops_worker(rank, world, layouts, out_dir):
    results = []
    for bounds, docs in layouts:
        T = bounds[-1] if bounds is not None else 160
        cu = None if docs is None else torch.tensor(docs)
        cp = ContextParallel(bounds=bounds)
        start, end = (bounds or shard_bounds(T, world))[rank : rank + 2]
        weights = torch.randn(1, T, H, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        for name in CASES:
            tensors = row(T, H, K, V, **CASES[name][3])
            o_ref, grads_ref = reference(name, tensors, weights, cu)
            leaves = {key: x[:, start:end].clone().requires_grad_(True) for key, x in tensors.items()}
            op, args, kwargs = case_call(name, leaves)
            sent = cp.sent_bytes
            o, _ = getattr(cp, op)(*args, **kwargs, cu_seqlens=cu)
            sent = cp.sent_bytes - sent
            (o * weights[:, start:end]).sum().backward()
            errors = {"o": rel_err(o, o_ref[:, start:end])}
            errors.update({f"d{key}": rel_err(leaves[key].grad, grads_ref[key][:, start:end]) for key in grads_ref})
            results.append(dict(case=f"{name} bounds={bounds} docs={docs}", errors=errors, sent=sent,
                                expected=8 * summary_numel(name, H, K, V, num_levels(T)), rank=rank))
    if world == 2:  # a backend without reduce-scatter: the backward's all-reduce gives the same gradients
        def refuse(*args, **kwargs):
            raise RuntimeError("reduce_scatter is not supported here")

        dist.reduce_scatter, kept = refuse, dist.reduce_scatter
        try:
            tensors, cu = row(150, H, K, V), torch.tensor((0, 20, 100, 150))
            weights = torch.randn(1, 150, H, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            o_ref, grads_ref = reference("linear-decay", tensors, weights, cu)
            start, end = (0, 64, 150)[rank : rank + 2]
            leaves = {key: x[:, start:end].clone().requires_grad_(True) for key, x in tensors.items()}
            o, _ = ContextParallel(bounds=(0, 64, 150)).linear_attn(*case_call("linear-decay", leaves)[1], cu_seqlens=cu)
            (o * weights[:, start:end]).sum().backward()
            errors = {f"d{key}": rel_err(leaves[key].grad, grads_ref[key][:, start:end]) for key in grads_ref}
            results.append(dict(case="all-reduce backward", errors=errors, rank=rank))
        finally:
            dist.reduce_scatter = kept
    (out_dir / f"ops-{rank}.json").write_text(json.dumps(results))


TRITON_CASES = ("linear-decay", "delta", "hla2")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (tests/conftest.py)


def _triton_worker(rank, world, out_dir):
    """The Triton forms (on the GPU, or the interpreter) in fp32 inside the context-parallel methods: the error
    against the float64 row within 2x that of the same context-parallel call on the fp32 PyTorch chunk forms,
    and a ceiling."""
    bounds, docs = (0, 45, 100), (0, 30, 100)
    cu = torch.tensor(docs)
    cp = ContextParallel(bounds=bounds)
    start, end = bounds[rank : rank + 2]
    part = lambda x: x[:, start:end].to(DEVICE)  # noqa: E731
    weights = torch.randn(1, 100, H, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for name in TRITON_CASES:
        tensors = {key: x.float().double() for key, x in row(100, H, 8, 12, **CASES[name][3]).items()}  # fp32-rounded
        o_ref, grads_ref = reference(name, tensors, weights, cu)
        errors = {}
        for impl in ("chunk", "triton"):
            leaves = {key: part(x).float().requires_grad_(True) for key, x in tensors.items()}
            op, args, kwargs = case_call(name, leaves)
            o, _ = getattr(cp, op)(*args, **kwargs, cu_seqlens=cu.to(DEVICE), impl=impl)
            (o * part(weights).float()).sum().backward()
            errors[impl] = {"o": rel_err(o, part(o_ref))}
            errors[impl].update({f"d{key}": rel_err(leaves[key].grad, part(grads_ref[key])) for key in grads_ref})
        checks = {key: (errors["triton"][key], errors["chunk"][key]) for key in errors["chunk"]}
        results.append(dict(case=f"{name} triton", checks=checks, rank=rank))
    (out_dir / f"triton-{rank}.json").write_text(json.dumps(results))


def layer_numel(mixer):
    """Per rank and forward of one layer: the short-convolution halo plus the summaries (distributed/README.md)."""
    H, K, V, cfg = mixer.heads, mixer.dk, mixer.dv, mixer.config
    if mixer.name in ("mamba2", "loglinear-mamba2"):
        halo, K, V = (cfg.conv_size - 1) * (mixer.d_inner + 2 * mixer.N), mixer.N, mixer.P
    else:
        halo = (cfg.conv_size - 1) * H * (2 * K + V)
    linear = lambda width: H * (K * width + 1)  # noqa: E731 - one linear_attn call with values `width` wide
    P = {"kata-m1": K * K, "kata-m2": 2 * (K // 2) ** 2, "kata-s2": (K // 2) ** 2, "deltakata-m1": K * K}.get(mixer.name)
    summaries = {
        "linear": linear(V), "mamba2": linear(V), "gdn": H * K * (K + V),
        "hla2": linear(K) + linear(V), "ahla": linear(V) + linear(V), "hla3": linear(K) + linear(V) + linear(V),
        "loglinear-mamba2": H * (cfg.max_levels * K * V + 1) if hasattr(cfg, "max_levels") else None,
        "loglinear-gdn": H * (cfg.max_levels * K * V + K * K) if hasattr(cfg, "max_levels") else None,
        "kata-m1": H * (P * (V + 1) + 1) if P else None, "kata-m2": H * (P * (V + 1) + 1) if P else None,
        "kata-s2": H * (P * (V + 1) + 1) if P else None, "deltakata-m1": H * P * (P + V) if P else None,
    }[mixer.name]
    if mixer.name == "hla3" and cfg.outer_decay:  # ops.hla: one exchange of the third-order scan element
        summaries = H * (1 + 3 * K * K + 3 * K * V)
    return halo + summaries


def _model_worker(rank, world, out_dir):
    mixers = ["linear", "mamba2", "gdn", "hla2", "ahla", "hla3", "loglinear-mamba2", "loglinear-gdn",
              "kata-m1", "kata-m2", "kata-s2", "deltakata-m1"]
    layer_mixers = [{"name": m, "num_heads": 2} for m in mixers] + [{"name": "hla3", "num_heads": 2, "outer_decay": True}]
    torch.manual_seed(0)
    config = LMConfig(vocab_size=11, d_model=8, n_layers=len(layer_mixers), layer_mixers=layer_mixers, mlp_ratio=0)
    model = CausalLM(config).double()
    ids = torch.randint(0, 11, (1, 96), generator=torch.Generator().manual_seed(2))
    results = []
    for docs in (None, (0, 20, 60, 96)):
        cu = None if docs is None else torch.tensor(docs)
        enable_context_parallel(model, False)
        model.zero_grad()
        logits_ref, _ = model(ids, cu_seqlens=cu)
        (logits_ref * logits_ref.detach().sin()).sum().backward()
        grads_ref = [p.grad.clone() for p in model.parameters()]
        enable_context_parallel(model)
        model.zero_grad()
        start, end = shard_bounds(96, world)[rank : rank + 2]
        logits, _ = model(ids[:, start:end], cu_seqlens=cu)
        (logits * logits_ref[:, start:end].detach().sin()).sum().backward()
        sent = [block.mixer.context_parallel.sent_bytes for block in model.blocks]
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(grads)  # the parameter gradients of the whole row are the sum over shards
        errors = {"logits": rel_err(logits, logits_ref[:, start:end]),
                  "params": rel_err(grads, torch.cat([g.flatten() for g in grads_ref]))}
        results.append(dict(case=f"model docs={docs}", errors=errors, rank=rank))
        for block, nbytes in zip(model.blocks, sent):
            results.append(dict(case=f"layer {block.mixer.name}", errors={}, sent=nbytes, expected=8 * layer_numel(block.mixer), rank=rank))
        with torch.no_grad():  # the check can fail: the shard alone, without the switch, is not its part of the row
            alone, _ = enable_context_parallel(model, False)(ids[:, start:end])
        results.append(dict(case=f"shard alone docs={docs}", alone=rel_err(alone, logits_ref[:, start:end]), rank=rank))
    (out_dir / f"model-{rank}.json").write_text(json.dumps(results))


def _entry(rank, world, store, job, args):
    torch.set_num_threads(1)  # one core per process, and no thread pool inherited across the fork
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        job(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(job, world, tmp_path, *args, timeout=60.0):
    """Run ``job(rank, world, *args)`` on ``world`` gloo processes, stopped past ``timeout`` seconds. Forked on a
    CPU-only machine: the children start with torch imported (spawning costs seconds each). Spawned where CUDA is:
    neither CUDA nor autograd's device threads (started by any earlier CUDA backward in this process) survive a fork."""
    start_method = "spawn" if torch.cuda.is_available() else "fork"
    run_ranks(_entry, world, (world, str(tmp_path / "store"), job, args), timeout=timeout, start_method=start_method)


def check_results(results):
    assert results, "no results came back"
    for r in results:
        if "checks" in r:  # low precision: 2x the PyTorch chunk form's error in the same dtype, floor and ceiling
            for name, (err, chunk_err) in r["checks"].items():
                bound = min(max(2 * chunk_err, LOW_PRECISION_FLOOR[torch.float32]), LOW_PRECISION_CEILING[torch.float32])
                assert err <= bound, f"rank {r['rank']} {r['case']} {name}: {err:.2e} > {bound:.2e} (chunk {chunk_err:.2e})"
            continue
        if "alone" in r:
            assert r["rank"] == 0 or r["alone"] > 1e-3, f"rank {r['rank']} {r['case']}: relative error {r['alone']:.1e}"
            continue
        worst = max(r["errors"].values(), default=0.0)
        assert worst <= TOL, f"rank {r['rank']} {r['case']}: relative errors {r['errors']}"
        if "sent" in r:  # the bytes of the summary exchange
            assert r["sent"] == r["expected"], f"rank {r['rank']} {r['case']}: sent {r['sent']} bytes, expected {r['expected']}"


@pytest.mark.parametrize("world", [2, 4])
def test_every_family_matches_one_process(world, tmp_path):
    spawn(_ops_worker, world, tmp_path, LAYOUTS[world], tmp_path)
    results = [r for rank in range(world) for r in json.loads((tmp_path / f"ops-{rank}.json").read_text())]
    assert len(results) == world * (len(LAYOUTS[world]) * len(CASES) + (world == 2))
    check_results(results)


def test_model_switch_matches_one_process(tmp_path):
    spawn(_model_worker, 2, tmp_path, tmp_path)
    check_results([r for rank in range(2) for r in json.loads((tmp_path / f"model-{rank}.json").read_text())])


def test_triton_forms_inside(tmp_path):
    spawn(_triton_worker, 2, tmp_path, tmp_path, timeout=120.0)
    check_results([r for rank in range(2) for r in json.loads((tmp_path / f"triton-{rank}.json").read_text())])


def test_layout():
    shards = shard_layout((0, 50, 64, 129, 160), (0, 30, 64, 100, 160))
    assert [s.offsets for s in shards] == [(0, 30, 50), (0, 14), (0, 36, 65), (0, 31)]
    assert [s.first_position for s in shards] == [0, 20, 0, 29]
    assert [s.last_position for s in shards] == [0, 20, 0, 29]
    assert [s.passes_through for s in shards] == [False, True, False, True]
    assert shard_bounds(8, 4) == (0, 2, 4, 6, 8)


@pytest.mark.parametrize(
    "bounds, docs, message",
    [((0, 5, 5, 9), None, "one shard of >= 1 token"), ((1, 9), None, "from 0"), ((0, 4, 9), (0, 3, 8), "to the whole row"),
     ((0, 4, 9), (0, 3, 3, 9), "strictly increasing")],
)
def test_layout_bad_input(bounds, docs, message):
    with pytest.raises(ValueError, match=message):
        shard_layout(bounds, docs)


@pytest.fixture
def one_rank(tmp_path):
    """A process group of this process alone (gloo)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield ContextParallel()
    dist.destroy_process_group()


def test_needs_a_process_group():
    with pytest.raises(ValueError, match="initialized torch.distributed process group"):
        ContextParallel()


def test_bad_input(one_rank):
    t = row(10, H, K, V)
    with pytest.raises(ValueError, match="expected 2 offsets"):
        ContextParallel(bounds=(0, 4, 10))
    with pytest.raises(ValueError, match="shard of 8 tokens"):
        ContextParallel(bounds=(0, 8)).linear_attn(t["q"], t["k"], t["v"])
    with pytest.raises(ValueError, match="initial_state=None and output_final_state=False"):
        one_rank.delta_rule(t["q"], t["k"], t["v"], t["beta"], output_final_state=True)
    q2 = t["q"].expand(2, -1, -1, -1)
    with pytest.raises(ValueError, match="B = 1"):
        one_rank.linear_attn(q2, q2, q2[..., :V], cu_seqlens=torch.tensor([0, 10]))
    model = CausalLM(LMConfig(vocab_size=5, d_model=8, n_layers=2, layer_mixers=["gdn", "softmax"]))
    with pytest.raises(ValueError, match="softmax"):
        enable_context_parallel(model)
    model = enable_context_parallel(CausalLM(LMConfig(vocab_size=5, d_model=8, n_layers=1, mixer="gdn")))
    with pytest.raises(ValueError, match="use_cache=False"):
        model(torch.zeros(1, 6, dtype=torch.int64), use_cache=True)
    one_rank_out, _ = model(torch.zeros(1, 6, dtype=torch.int64))  # one rank: the plain model
    assert torch.equal(one_rank_out, enable_context_parallel(model, False)(torch.zeros(1, 6, dtype=torch.int64))[0])


def test_context_parallel_run_checks_every_rank_against_one_process(tmp_path):
    """`benchmarks/context_parallel_run.py` under torchrun on two gloo ranks: a row per case with the step, the
    compute alone and the collective timed, every output and gradient within its bound of the one-process op;
    a bound no run can meet stops it with a ValueError that names the case."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "context_parallel_run.py"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
              "--device", "cpu", "--T", "200", "--cases", "delta_rule", "kata_m2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(launch + ["--out", str(tmp_path)], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "context_parallel_run.json").read_text())
    assert result["world_size"] == 2 and [r["case"] for r in result["rows"]] == ["delta_rule", "kata_m2"]
    for entry in result["rows"]:
        assert entry["shard"] == 100 and entry["summary_bytes_per_rank"] > 0
        assert all(entry[f"{k}_ms"] > 0 for k in ("cp_fwd", "cp_fwdbwd", "local_fwd", "local_fwdbwd", "comm"))
        errors = {k: v for k, v in entry.items() if k.startswith("rel_err_")}
        assert set(errors) >= {"rel_err_o", "rel_err_dq", "rel_err_dk", "rel_err_dv", "rel_err_dg"}
        assert all(v <= 1e-4 for v in errors.values()), errors
    strict = subprocess.run(launch[:-3] + ["--cases", "kata_m2", "--rtol", "1e-30", "--out", str(tmp_path / "strict")],
                            capture_output=True, text=True, timeout=240, env=env)
    assert strict.returncode != 0 and "kata_m2 at T = 200 on 2 ranks differs from one process" in strict.stderr
