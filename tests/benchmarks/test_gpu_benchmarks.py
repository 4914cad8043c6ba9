"""The benchmark scripts at toy sizes (on CPU the Triton forms run under the interpreter): `train_step.py`
finds one graph with the custom ops in it and equal losses, and reports a graph break as a failure;
`hf_generate.py` counts the fused decoding steps and reports a mismatch as a failure; `memory_peak.py` counts live
bytes."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from polyattn.models import CausalLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOY_TRAIN = ["--device", DEVICE, "--backend", "aot_eager", "--d-model", "16", "--layers", "1", "--heads", "2",
             "--batch", "1", "--seqlen", "8", "--warmup", "0", "--steps", "1"]
TOY_GENERATE = ["--device", DEVICE, "--hidden", "16", "--layers", "1", "--heads", "2", "--batch-sizes", "2",
                "--prompt", "5", "--new-tokens", "3", "--repeat", "1"]


def test_train_step_compiles_the_triton_custom_ops_and_matches_eager(tmp_path):
    train_step = load("train_step")
    out = tmp_path / "train.json"
    assert train_step.main([*TOY_TRAIN, "--impl", "triton", "--mixers", "linear", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["custom_ops"] == ["polyattn.linear_attn_forward.default"]
    assert row["form"] == "triton" and row["failures"] == []
    assert (row["graph_count"], row["graph_break_count"]) == (1, 0)
    assert len(row["eager_losses"]) == len(row["compiled_losses"]) == 1 and math.isfinite(row["eager_losses"][0])
    assert row["max_loss_rel_diff"] <= row["loss_rtol"] and row["compiled_ms"] > 0


def test_train_step_reports_a_graph_break(tmp_path, monkeypatch):
    train_step = load("train_step")
    logits = CausalLM.logits

    def broken(self, hidden):
        torch._dynamo.graph_break()
        return logits(self, hidden)

    monkeypatch.setattr(CausalLM, "logits", broken)
    out = tmp_path / "train.json"
    assert train_step.main([*TOY_TRAIN, "--mixers", "softmax", "--out", str(out)]) == 1
    (row,) = json.loads(out.read_text())["rows"]
    assert row["graph_break_count"] >= 1 and row["break_reasons"]
    assert row["failures"] == [f"{row['graph_count']} graphs, {row['graph_break_count']} breaks: {row['break_reasons']}"]


def test_hf_generate_counts_fused_steps(tmp_path):
    hf_generate = load("hf_generate")
    out = tmp_path / "generate.json"
    assert hf_generate.main([*TOY_GENERATE, "--mixers", "linear,gdn,deltakata-m1,kata-m2,loglinear-gdn", "--decode-impls", "triton,recurrent",
                             "--out", str(out)]) == 0
    rows = {(row["mixer"], row["decode_impl"]): row for row in json.loads(out.read_text())["rows"]}
    assert rows["linear", "triton"]["fused_steps_B2"] == {"linear_attn_step_inplace": 2}  # 1 layer, 2 one-token calls
    assert rows["gdn", "triton"]["fused_steps_B2"] == {"delta_rule_step_inplace": 2}
    assert rows["deltakata-m1", "triton"]["fused_steps_B2"] == {"deltakata_step": 2}  # DeltaKATA's own step (PSD map)
    assert rows["kata-m2", "triton"]["fused_steps_B2"] == {"kata_step": 2}
    assert rows["loglinear-gdn", "triton"]["fused_steps_B2"] == {"loglinear_attn_step_inplace": 2}  # the Gated DeltaNet base
    for key in [(mixer, "recurrent") for mixer in ("linear", "gdn", "deltakata-m1", "kata-m2", "loglinear-gdn")]:
        assert rows[key]["decode_form"] == "recurrent" and rows[key]["fused_steps_B2"] == {} and rows[key]["failures"] == []
        assert rows[key]["B2"] > 0


@pytest.mark.parametrize("claimed", ["triton", "recurrent"])
def test_hf_generate_reports_steps_that_do_not_match_the_form(tmp_path, monkeypatch, claimed):
    hf_generate = load("hf_generate")
    monkeypatch.setattr(hf_generate, "mixer_form", lambda *args: claimed)
    decode_impl = "recurrent" if claimed == "triton" else "triton"
    out = tmp_path / "generate.json"
    assert hf_generate.main([*TOY_GENERATE, "--mixers", "linear", "--decode-impls", decode_impl,
                             "--out", str(out)]) == 1
    (row,) = json.loads(out.read_text())["rows"]
    assert "fused steps" in row["failures"][0]


def test_kernel_benchmark_differentiates_each_rows_inputs():
    """The leaves of a fwd+bwd row (shared by the benchmark and `profile_kernels.py`): g where the op is
    gated, beta for the delta rules, lam for log-linear attention."""
    from polyattn.bench import kernels

    q, k, v, g, beta = (torch.zeros(1) for _ in range(5))
    lam = torch.zeros(1)

    def fn():
        return None

    fn.extra_leaves = [lam]
    by_op = {c.op: c for c in kernels.cases()}
    ids = lambda xs: [id(x) for x in xs]  # noqa: E731
    assert ids(kernels.leaves(by_op["linear_attn"], lambda: None, q, k, v, g, beta)) == ids([q, k, v])
    assert ids(kernels.leaves(by_op["deltakata_lorentz"], lambda: None, q, k, v, g, beta)) == ids([q, k, v, g, beta])
    assert ids(kernels.leaves(by_op["loglinear_mamba2"], fn, q, k, v, g, beta)) == ids([q, k, v, g, lam])


def test_launch_means_tells_passes_apart():
    """Per-launch means over identical calls: one row per place in the call, a kernel launched twice per
    call gets two rows; calls that launched different kernels are refused."""
    from polyattn.bench.timing import launch_means

    call = [("outputs", 10.0), ("states", 2.0), ("outputs", 30.0)]
    second = [("outputs", 20.0), ("states", 4.0), ("outputs", 50.0)]
    assert launch_means(call + second, 2) == {"00 outputs": 0.015, "01 states": 0.003, "02 outputs": 0.04}
    with pytest.raises(ValueError, match="different kernels"):
        launch_means(call + second[:2], 2)
    with pytest.raises(ValueError, match="launch 1 differs"):
        launch_means(call + [("outputs", 1.0), ("scan", 1.0), ("outputs", 1.0)], 2)


def test_tune_kernels_sweeps_the_family_presets_and_checks_configs_first(capsys, monkeypatch):
    """Presets by the ops' kernel family, --set configs checked as KernelConfig fields, one family per sweep,
    and no GPU: a clear refusal after the checks."""
    tune = load("tune_kernels")
    assert tune.family("linear_attn_decay") == tune.family("loglinear_mamba2") == "linear"
    assert tune.family("kata_s2") == tune.family("deltakata_m1") == "kata" and tune.family("delta_rule") == "delta"
    assert tune.configs_for(["kata_m1"], [0, 1], ['{"kata_num_warps": 4}']) == [{}, {"kata_score_dot": "rounded"}, {"kata_num_warps": 4}]
    with pytest.raises(TypeError, match="bogus"):
        tune.configs_for(["linear_attn"], [0], ['{"bogus": 1}'])
    with pytest.raises(SystemExit, match="one kernel family"):
        tune.configs_for(["linear_attn", "kata_m1"], None, [])
    with pytest.raises(SystemExit, match="indices below"):
        tune.configs_for(["delta_rule"], [99], [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        tune.main(["--ops", "linear_attn"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
    from polyattn.bench import kernels

    ours = [c for c in kernels.cases() if c.op == "linear_attn" and c.impl == "polyattn-triton"]
    rows = [dict(op="linear_attn", impl="fla-chunk_linear_attn", D=128, T=2048, mode="fwd", config=None, ms=2.0, peak_gib=0.5),
            dict(op="linear_attn", impl="polyattn-triton", D=128, T=2048, mode="fwd", config=0, ms=1.0, peak_gib=1.25),
            dict(op="linear_attn", impl="polyattn-triton", D=128, T=2048, mode="fwd", config=1, ms="error: X", peak_gib=None),
            dict(op="linear_attn", impl="polyattn-triton", D=128, T=2048, mode="fwd", config=2, ms=3.0, peak_gib=None)]
    text = tune.table(rows, [{}, {"num_warps": 8}, {"num_stages": 1}], ours, [(128, 2048, "fwd")])
    assert "| linear_attn | 128 | 2048 | fwd | fla-chunk_linear_attn 2.000, 0.50 GiB | 1.000 (0.50), 1.25 GiB | error | 3.000 (1.50) |" in text


def test_profile_kernels_refuses_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU build, wherever the test runs
    with pytest.raises(SystemExit):
        load("profile_kernels").main(["--ops", "kata_m1"])
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_kernel_tables_give_time_and_peak_memory_ratios():
    """The markdown's ratio rows: time for every measured pair, peak memory where both rows recorded it,
    nothing for a failed anchor."""
    from polyattn.bench import kernels

    rows = [dict(op="loglinear_gdn", impl="polyattn-triton", T=2048, K=128, mode="fwdbwd", ms=30.0, peak_gib=6.0),
            dict(op="delta_rule", impl="polyattn-triton", T=2048, K=128, mode="fwdbwd", ms=10.0, peak_gib=2.0),
            dict(op="softmax", impl="sdpa-cudnn", T=2048, K=128, mode="fwdbwd", ms="error: X", peak_gib=None)]
    text = kernels.ratio_table(rows, "device")
    assert "| loglinear_gdn / polyattn-triton | delta_rule / polyattn-triton | fwdbwd | 3.00x |" in text
    assert "| loglinear_gdn / polyattn-triton | delta_rule / polyattn-triton | peak memory, fwdbwd | 3.00x |" in text
    assert "softmax / sdpa-cudnn | fwdbwd" not in text
    if torch.cuda.is_available():
        assert kernels.peak_bytes(lambda: torch.empty(2**20, dtype=torch.uint8, device="cuda")) >= 2**20
    else:
        assert kernels.peak_bytes(lambda: None) is None


def test_kernel_plot_of_one_mode_warns_of_nothing(tmp_path):
    """A run of one mode (`--modes fwdbwd`) plots without matplotlib's empty-legend warning: the other panel
    says it has no rows."""
    import warnings

    from polyattn.bench import kernels

    rows = [dict(op="delta_rule", impl="polyattn-triton", T=t, B=65536 // t, H=16, K=128, V=128, mode="fwdbwd", ms=1.0 + t / 8192)
            for t in (2048, 8192)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.plot(rows, tmp_path / "kernels.png")
    assert (tmp_path / "kernels.png").stat().st_size > 0


def test_gdn_products_follow_the_level_skip_rules(tmp_path, capsys):
    """`gdn_products.passes` at two chunks (one level): chunk 0 writes and carries (`W h` and the carry, five
    passes), chunk 1 reads and, the sequence's last, carries too; the backward's chain forms x (`W h`) at both,
    carries out of chunk 0 only (chunk 1's state leaves the walk), and adds `K̃ dh'` and `W^T dx` at both and the
    read's term at chunk 1; the gradients form dW, dK̃ (+ dO h^T at the read). With a profile, the rate is the
    count over the kernel's time."""
    products = load("gdn_products")
    got = products.passes(2)
    assert got == {"gdn_levels_kernel (forward)": 13, "gdn_levels_kernel (rerun)": 10, "gdn_levels_chain_kernel": 20,
                   "gdn_levels_grads_kernel": 14}
    assert products.passes(4)["gdn_levels_kernel (rerun)"] < 4 * 10  # level 1's block skips W h at its first chunk
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"row": {"00 gdn_levels_grads_kernel": 1.0, "01 gdn_levels_grads_kernel": 1.0,
                                           "02 gdn_levels_kernel": 2.0, "03 wy_kernel": 0.5}}))
    products.main(["--T", "128", "--profile", str(profile)])
    out = capsys.readouterr().out
    tflop = 14 * 2 * 64 * 128 * 128 * 16 * (65536 // 128) / 1e12
    assert f"{tflop:6.2f} TFLOP, 2.00 ms, {tflop / 2 * 1e3:.0f} TFLOP/s" in out


def test_dg_identity_compares_each_way_against_the_chunk_forms_bound():
    """`dg_identity.py` at a toy size: every way of forming dg is measured, and the kernels' way (the per-token dots of
    fp32 dq and dk) stays within the bound the tests set."""
    errors = load("dg_identity").errors(1, 65, 1, 8, 12, torch.bfloat16, seed=1)
    assert set(errors) == {"chunk form", "bound", "q·dq − k·dk", "q·dq − v·dv", "do·o − k·dk", "do·o − v·dv"}
    assert all(math.isfinite(e) and e >= 0 for e in errors.values())
    assert errors["q·dq − k·dk"] <= errors["bound"]


def test_memory_peak_counts_live_bytes():
    """`memory_peak.py`'s counter: the peak of live storage bytes of a hand-counted sequence (the excluded input
    never counts, a freed result stops counting); then, on the CPU (the script runs the kernels under the
    interpreter), the script at a toy shape, whose kinds account for every byte of its peak (it asserts that) and
    whose replay is positive at every benchmark shape."""
    memory_peak = load("memory_peak")
    x = torch.ones(1024)
    with memory_peak.LiveBytes(x) as counter:
        y = x * 2  # 4 KiB
        z = y + 1  # 8 KiB live
        del y
        w = z * 3  # 8 KiB live again
    assert counter.peak == 8192 and w.numel() == 1024
    if DEVICE == "cpu":
        result = memory_peak.main(["--B", "1", "--T", "75", "--H", "1", "--K", "16", "--V", "8", "--C", "16"])  # kinds unlike
        assert result["peak_bytes"] > 0 and sorted(result["replayed"]) == [2048, 8192, 32768, 131072]
        assert all(r["gib"] > 0 for r in result["replayed"].values())
