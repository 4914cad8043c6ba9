"""The CPU demo end to end at 2 steps: JSON, tables, PNGs, and the exact decoding check."""

import json

from polyattn.train.demo import run_demo


def test_demo_writes_tables_plots_and_an_exact_decoding_check(tmp_path, capsys):
    summary = run_demo(str(tmp_path), mixers=["softmax", "kata-m1"], steps=2, workers=1)
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert set(saved["studies"]) == {"mqar", "overwrite"}
    mqar = saved["studies"]["mqar"]
    assert [r["mixer"] for r in mqar["results"]] == ["softmax", "kata-m1"]
    assert [(e["length"], e["pairs"]) for e in mqar["results"][0]["eval"]][-1] == (1024, 64)
    assert saved["decode_check"]["mixer"] == "kata-m1"
    assert saved["decode_check"]["float64"] <= 1e-9 and saved["decode_check"]["float32"] <= 1e-4
    for name in ("accuracy_vs_state.png", "accuracy_vs_length.png", "overwrite_accuracy_vs_length.png", "table.txt"):
        assert (tmp_path / name).stat().st_size > 0
    out = capsys.readouterr().out
    assert "T1024/P64*" in out and "decoding check" in out
    assert summary["wall_s"] > 0
