"""Evidence configs (`benchmarks/evidence/`): every committed config runs end to end at its toy size, its
full size passes every check; the claim rules; bad configs refused before any training."""

import argparse
import json
from pathlib import Path

import pytest

from polyattn.cli import main
from polyattn.train.claims import bucket_means, check_claims, claim_rows, judge, log2_edges
from polyattn.train.commands import add_sweep_arguments, plan_sweep

EVIDENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "evidence"
CONFIGS = sorted(EVIDENCE.glob("*.json"))
ROW_KEYS = {"claim", "source", "source_value", "ours", "holds_if", "holds", "command"}


def expected_value(cell, row):
    """A cell's metric from its eval row, computed here: buckets [0, 1), [1, 2), [2, 4), ... unless the cell names them."""
    metric = cell.get("metric", "accuracy")
    if metric != "loss_by_position":
        return row[metric]
    length = row["length"]
    edges = cell.get("buckets") or [0, *(2**k for k in range(length.bit_length()) if 2**k < length), length]
    values = {}
    for a, b in zip(edges, edges[1:]):
        scored = [x for x in row["loss_by_position"][a:b] if x is not None]
        values[f"[{a},{b})"] = sum(scored) / len(scored) if scored else None
    return values


def plan(argv):
    """The `SweepPlan` of ``polyattn ARGV`` (nothing trained)."""
    parser = argparse.ArgumentParser()
    add_sweep_arguments(parser)
    args = parser.parse_args(argv[1:])
    args.argv = argv
    return plan_sweep(args)


def test_the_evidence_configs_are_committed():
    assert {p.stem for p in CONFIGS} >= {"mqar-extrapolation", "mqar-loglinear", "mqar-hla", "mqar-hla3", "mqar-hybrid", "mqar-kata-variants", "overwrite", "niah",
                                          "text-loss-by-position"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_runs_at_toy_size_and_measures_every_claim(path, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["sweep", "--config", str(path), "--toy", "--device", "cpu", "--out", str(out)]
    assert main(argv) == 0
    assert "train tok/s" in capsys.readouterr().out
    spec = json.loads(path.read_text())
    rows = json.loads((out / "claims.json").read_text())
    summary = json.loads((out / "sweep.json").read_text())
    best = [next(r for r in summary["runs"] if (r["mixer"], r["config"]["d_model"], r["config"]["lr"]) == (b["mixer"], b["d_model"], b["lr"]))
            for b in summary["best"]]
    rows_of = {(r["mixer"], r["config"]["d_model"], e["length"], e["pairs"]): e for r in best for e in r["eval"]}
    assert len(rows) == len(spec["claims"])
    for row, claim in zip(rows, spec["claims"]):
        assert set(row) == ROW_KEYS and row["command"] == "polyattn " + " ".join(argv)
        assert row["source_value"] == claim["source_value"]
        cells = {claim["ours"]["mixer"]: claim["ours"]} if "mixer" in claim["ours"] else claim["ours"]
        ours = row["ours"] if isinstance(row["ours"], dict) else {next(iter(cells)): row["ours"]}
        assert ours == {name: expected_value(c, rows_of[(c["mixer"], c["width"], *c["slice"])]) for name, c in cells.items()}  # measured
        assert row["holds"] == judge(claim["holds"], ours)
    assert "| claim | source |" in (out / "claims.md").read_text()
    assert all(r["train"]["tokens_per_s"] > 0 for r in summary["runs"])
    assert (out / "accuracy_vs_length.png").exists()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_full_config_passes_every_check(path, tmp_path):
    full = plan(["sweep", "--config", str(path), "--out", str(tmp_path / "out")])  # every cell on the meta device, the claims' cells
    spec = json.loads(path.read_text())
    assert {"impl", "device"}.isdisjoint(spec["sweep"]) and full.base.impl == "auto" and full.base.device == "auto"
    assert len(full.lrs) >= 2 and set(full.lrs) <= {1e-3, 3.2e-3, 1e-2, 3.2e-2} and full.base.steps == spec["sweep"]["steps"]
    assert full.score == spec["sweep"].get("score", "accuracy")
    assert spec["description"] and "GPU minutes" in spec["description"]


def fake_best(accuracies):
    """Best-LR results as `sweep` returns them: ``{(mixer, width): accuracy at slice (256, 16)}``."""
    return [{"mixer": m, "config": {"d_model": w}, "eval": [{"length": 256, "pairs": 16, "accuracy": a}]} for (m, w), a in accuracies.items()]


def cell(mixer, width=64):
    return {"mixer": mixer, "width": width, "slice": [256, 16]}


def claim(ours, holds, source_value=None):
    return {"claim": "c", "source": "s", "source_value": source_value, "ours": ours, "holds": holds}


@pytest.mark.parametrize(
    "rule, ours, expected",
    [
        ({"at_least": 0.99}, {"a": 0.99}, True),
        ({"at_least": 0.99}, {"a": 0.989}, False),
        ({"at_least": 0.5}, {"a": 0.6, "b": 0.4}, False),
        ({"ahead_of": "b"}, {"a": 0.6, "b": 0.4}, True),
        ({"ahead_of": "b"}, {"a": 0.4, "b": 0.4}, False),  # a tie is not ahead
        ({"ahead_of": "c"}, {"a": 0.9, "b": 0.2, "c": 0.3}, False),  # every other cell must be ahead
        (None, {"a": 0.1}, None),
        ({"below": "b"}, {"a": 1.9, "b": 2.0}, True),
        ({"below": "b"}, {"a": 2.0, "b": 2.0}, False),  # a tie is not below
        ({"below": "c"}, {"a": 1.0, "b": 2.5, "c": 2.0}, False),  # every other cell must be below
        ({"below": "b"}, {"a": {"[0,1)": 1.0, "[1,2)": 2.0}, "b": {"[0,1)": 1.5, "[1,2)": 2.5}}, True),
        ({"below": "b"}, {"a": {"[0,1)": 1.0, "[1,2)": 2.6}, "b": {"[0,1)": 1.5, "[1,2)": 2.5}}, False),  # every bucket
        ({"below": "b"}, {"a": {"[0,1)": None}, "b": {"[0,1)": 1.5}}, False),  # a bucket without scored positions
    ],
    ids=["at-least-equal", "at-least-below", "at-least-every-cell", "ahead", "tie", "ahead-every-cell", "reported",
         "below", "below-tie", "below-every-cell", "below-every-bucket", "bucket-above", "bucket-unscored"],
)
def test_judge(rule, ours, expected):
    assert judge(rule, ours) is expected


def test_claim_rows_read_the_best_cells():
    best = fake_best({("gdn", 64): 0.2, ("kata-m2", 64): 0.9, ("kata-m2", 128): 0.95})
    claims = [claim(cell("kata-m2", 128), {"at_least": 0.9}, 0.908),
              claim({"kata-m2": cell("kata-m2"), "gdn": cell("gdn")}, {"ahead_of": "gdn"}, {"gdn": 0.004})]
    check_claims(claims, ["gdn", "kata-m2"], [64, 128], [(256, 16)])
    single, pair = claim_rows(claims, best, "polyattn sweep --config x.json --out o")
    assert single["ours"] == 0.95 and single["holds"] is True and single["holds_if"] == "ours >= 0.9"
    assert pair["ours"] == {"kata-m2": 0.9, "gdn": 0.2} and pair["holds"] is True and pair["holds_if"] == "kata-m2 > gdn"
    assert single["command"] == "polyattn sweep --config x.json --out o"


def test_log2_buckets_of_a_hand_computed_example():
    assert log2_edges(2048) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert log2_edges(5) == [0, 1, 2, 4, 5] and log2_edges(1) == [0, 1]
    by_position = [4.0, 3.0, 2.0, 1.0, None, 6.0]  # t = 5 scored, t = 4 not
    assert bucket_means(by_position, log2_edges(6)) == {"[0,1)": 4.0, "[1,2)": 3.0, "[2,4)": 1.5, "[4,6)": 6.0}
    assert bucket_means(by_position, [0, 4, 5]) == {"[0,4)": 2.5, "[4,5)": None}


def test_claim_rows_read_loss_and_loss_by_position():
    def run(mixer, loss, by_position):
        return {"mixer": mixer, "config": {"d_model": 64},
                "eval": [{"length": 4, "pairs": 0, "accuracy": 0.5, "loss": loss, "loss_by_position": by_position}]}

    best = [run("gdn", 2.0, [3.0, 2.0, 2.0, 1.0]), run("loglinear-gdn", 2.5, [2.0, 1.0, 3.0, 0.0])]
    cell = lambda mixer, **extra: {"mixer": mixer, "width": 64, "slice": [4, 0], **extra}  # noqa: E731
    claims = [claim(cell("gdn", metric="loss"), None),
              claim({"loglinear-gdn": cell("loglinear-gdn", metric="loss_by_position"), "gdn": cell("gdn", metric="loss_by_position")},
                    {"below": "gdn"}),
              claim({"loglinear-gdn": cell("loglinear-gdn", metric="loss_by_position", buckets=[0, 2, 4]),
                     "gdn": cell("gdn", metric="loss_by_position", buckets=[0, 2, 4])}, {"below": "gdn"}),
              claim({"loglinear-gdn": cell("loglinear-gdn", metric="loss"), "gdn": cell("gdn", metric="loss")}, {"below": "gdn"})]
    check_claims(claims, ["gdn", "loglinear-gdn"], [64], [(4, 0)])
    mean, log2, halves, means = claim_rows(claims, best, "polyattn sweep")
    assert mean["ours"] == 2.0 and mean["holds"] is None
    assert log2["ours"] == {"loglinear-gdn": {"[0,1)": 2.0, "[1,2)": 1.0, "[2,4)": 1.5}, "gdn": {"[0,1)": 3.0, "[1,2)": 2.0, "[2,4)": 1.5}}
    assert log2["holds"] is False and log2["holds_if"] == "loglinear-gdn < gdn in every bucket"  # a tie in [2,4)
    assert halves["ours"] == {"loglinear-gdn": {"[0,2)": 1.5, "[2,4)": 1.5}, "gdn": {"[0,2)": 2.5, "[2,4)": 1.5}} and halves["holds"] is False
    assert means["ours"] == {"loglinear-gdn": 2.5, "gdn": 2.0} and means["holds"] is False and means["holds_if"] == "loglinear-gdn < gdn"


def loss_cell(mixer="gdn", **extra):
    return {"mixer": mixer, "width": 64, "slice": [256, 16], **extra}


@pytest.mark.parametrize(
    "claims, match",
    [
        ([claim(cell("softmax"), None)], "mixer 'softmax' is not in the sweep's mixers"),
        ([claim(cell("gdn", 32), None)], "width 32 is not in the sweep's widths"),
        ([claim({"mixer": "gdn", "width": 64, "slice": [512, 16]}, None)], "slice [512, 16] is not a test slice"),
        ([claim(cell("gdn"), {"ahead_of": "gdn"})], "ahead_of expects one of two or more named cells"),
        ([claim(cell("gdn"), {"above": 0.5})], "expected null, {\"at_least\": NUMBER}"),
        ([claim({"a": cell("gdn")}, None, {"b": 0.5})], "names ['b'] are not cells of ours"),
        ([{"claim": "c", "ours": cell("gdn")}], "expected the keys"),
        ([], "expected a non-empty list of claims"),
        ([claim(loss_cell(metric="perplexity"), None)], "metric: expected one of ['accuracy', 'loss', 'loss_by_position'], got 'perplexity'"),
        ([claim(loss_cell(metric="loss", buckets=[0, 1]), None)], "buckets: only a \"loss_by_position\" cell has buckets"),
        ([claim(loss_cell(metric="loss_by_position", buckets=[0, 4, 2]), None)], "buckets: expected two or more increasing integer edges in [0, 256]"),
        ([claim(loss_cell(metric="loss_by_position", buckets=[0, 512]), None)], "buckets: expected two or more increasing integer edges"),
        ([claim(loss_cell(metric="loss_by_position", buckets=[8]), None)], "buckets: expected two or more increasing integer edges"),
        ([claim({"a": loss_cell(), "b": loss_cell()}, {"below": "b"})], "below judges cells of metric loss or loss_by_position, these read 'accuracy'"),
        ([claim({"a": loss_cell(metric="loss"), "b": loss_cell(metric="loss")}, {"ahead_of": "b"})], "ahead_of judges cells of metric accuracy"),
        ([claim({"a": loss_cell(metric="loss"), "b": loss_cell(metric="loss")}, {"below": "c"})], "below expects one of two or more named cells"),
        ([claim({"a": loss_cell(metric="loss"), "b": loss_cell(metric="loss_by_position")}, None)], "expected every cell to read one metric"),
        ([claim({"a": loss_cell(metric="loss_by_position"), "b": loss_cell(metric="loss_by_position", buckets=[0, 8])}, {"below": "b"})],
         "expected every cell to read one metric (and the same buckets)"),
    ],
    ids=["mixer", "width", "slice", "ahead-of-self", "rule", "source-names", "keys", "empty", "metric", "buckets-not-by-position",
         "buckets-order", "buckets-past-length", "buckets-one-edge", "below-accuracy", "ahead-of-loss", "below-unknown", "mixed-metrics",
         "mixed-buckets"],
)
def test_check_claims_rejects_cells_outside_the_sweep(claims, match):
    with pytest.raises(ValueError) as err:
        check_claims(claims, ["gdn"], [64], [(256, 16)])
    assert match in str(err.value)


TINY_SWEEP = {"task": "mqar", "task_options": {"vocab_size": 64}, "train": [[32, 32, 4]], "test": [[32, 8, 4], [64, 8, 8]],
              "mixers": ["linear", "gdn"], "widths": [16], "lrs": [1e-2], "steps": 3, "batch_size": 4, "device": "cpu"}
TINY_CLAIM = claim({"gdn": {"mixer": "gdn", "width": 16, "slice": [64, 8]}, "linear": {"mixer": "linear", "width": 16, "slice": [64, 8]}},
                   {"ahead_of": "linear"})


def write_config(tmp_path, **changes):
    spec = {"description": "tiny", "sweep": dict(TINY_SWEEP), "toy": {"steps": 2}, "claims": [TINY_CLAIM]}
    for key, value in changes.items():
        block, _, name = key.partition("__")
        if name:
            spec[block][name] = value
        elif value is None:
            del spec[block]
        else:
            spec[block] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(spec))
    return str(path)


def test_flags_override_the_toy_block_which_overrides_the_config(tmp_path):
    config, out = write_config(tmp_path), str(tmp_path / "out")
    assert plan(["sweep", "--config", config, "--out", out]).base.steps == 3
    assert plan(["sweep", "--config", config, "--toy", "--out", out]).base.steps == 2
    toy = plan(["sweep", "--config", config, "--toy", "--steps", "1", "--lrs", "1e-3,1e-2", "--out", out])
    assert toy.base.steps == 1 and toy.lrs == [1e-3, 1e-2] and toy.mixers == ["linear", "gdn"]
    assert plan(["sweep", "--config", config, "--steps", "5", "--toy", "--out", out]).base.steps == 5  # wherever the flag stands


@pytest.mark.parametrize(
    "changes, flags, match",
    [
        ({"sweep__bogus": 1}, [], "sweep.bogus: unknown sweep argument"),
        ({"sweep__out": "x"}, [], "sweep.out: unknown sweep argument"),
        ({"sweep__workers": 2}, [], "sweep.workers: unknown sweep argument"),
        ({"toy__epochs": 1}, ["--toy"], "toy.epochs: unknown sweep argument"),
        ({"sweep__mixers": ["linear", "nope"]}, [], "unknown mixers ['nope']"),
        ({"sweep__mixers": ["linear"]}, [], "mixer 'gdn' is not in the sweep's mixers"),
        ({"sweep__test": [[32, 8, 4]]}, [], "slice [64, 8] is not a test slice"),
        ({"sweep__widths": [32]}, [], "width 16 is not in the sweep's widths"),
        ({"sweep__mixer_configs": {"softmax": {"num_heads": 1}}}, [], "--mixer-configs: 'softmax' is not one of the sweep's mixers"),
        ({"sweep__mixer_configs": {"gdn": {"bogus": 1}}}, [], "unknown options ['bogus']"),
        ({"sweep__steps": 0}, [], "steps: expected an integer in [1, inf], got 0"),
        ({"sweep__no_bf16": "yes"}, [], "sweep.no_bf16: expected true or false"),
        ({"sweep__mixers": ["linear", "gdn", "x+y"], "sweep__hybrids": {"x+y": ["linear", "nope"]}}, [],
         "hybrids: 'x+y': layer_mixers[1]: unknown mixer 'nope'"),
        ({"sweep__mixers": ["linear", "gdn", "x+y"], "sweep__hybrids": {"x+y": ["linear"]}}, [], "hybrids: 'x+y': layer_mixers: expected 2 entries"),
        ({"sweep__mixers": ["linear", "gdn", "x+y"], "sweep__hybrids": {"x+y": ["linear", {"name": "gdn", "bogus": 1}]}}, [],
         "unknown options ['bogus'] for mixer 'gdn'"),
        ({"sweep__mixers": ["linear", "gdn", "x+y"], "sweep__hybrids": {"x+y": ["linear", "gdn"]}, "sweep__mixer_configs": {"x+y": {}}}, [],
         "--mixer-configs: 'x+y' is not one of the sweep's mixers"),
        ({"sweep__hybrids": {"gdn": ["linear", "gdn"]}}, [], "hybrids: name: expected letters, digits and . _ + - other than a registered"),
        ({"sweep__mixers": ["linear", "gdn", "x+z"], "sweep__hybrids": {"x+y": ["linear", "gdn"]}}, [], "unknown mixers ['x+z']"),
        ({"sweep__score": "perplexity"}, [], "score: expected one of ['accuracy', 'loss'], got 'perplexity'"),
        ({"claims": [{**TINY_CLAIM, "holds": {"below": "linear"}}]}, [], "below judges cells of metric loss or loss_by_position"),
        ({"claims": [claim({"mixer": "gdn", "width": 16, "slice": [64, 8], "metric": "loss_by_position", "buckets": [0, 128]}, None)]}, [],
         "buckets: expected two or more increasing integer edges in [0, 64]"),
        ({"toy": None}, ["--toy"], "--toy needs a 'toy' object"),
        ({"extra": {}}, [], "expected an object with a 'sweep' object"),
    ],
    ids=["unknown-key", "out-key", "workers-key", "toy-key", "unknown-mixer", "claim-mixer", "claim-slice", "claim-width", "mixer-configs-name",
         "mixer-configs-option", "steps", "bool", "hybrid-entry", "hybrid-length", "hybrid-option", "hybrid-mixer-configs", "hybrid-name",
         "hybrid-unknown", "score", "claim-rule-metric", "claim-buckets", "no-toy", "top-level"],
)
def test_bad_config_is_refused_before_any_training(changes, flags, match, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["sweep", "--config", write_config(tmp_path, **changes), *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polyattn: error: ") and match in err, err
    assert not (out / "sweep.json").exists()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["sweep", "--toy"], "--toy: expected --config FILE"),
        (["sweep", "--config", "missing.json", "--out", "o"], "--config: cannot read 'missing.json'"),
        (["sweep", "--config", "CONFIG"], "expected --out"),
    ],
    ids=["toy-alone", "missing-file", "no-out"],
)
def test_config_flags_are_checked(argv, match, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [write_config(tmp_path) if a == "CONFIG" else a for a in argv]
    assert main(argv) == 2
    assert match in capsys.readouterr().err
