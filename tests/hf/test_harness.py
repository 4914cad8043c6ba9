"""The lm-eval entry: ``polyattn-lm-eval run --model polyattn`` evaluates a saved model on a local
two-example task, with loglikelihoods equal to the model's own; and the byte tokenizer."""

import json
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from polyattn.hf.tokenizer import byte_tokenizer

DOCS = [
    {"question": "1 + 1 =", "choices": [" 2", " 3"], "answer": 0},
    {"question": "the sky is", "choices": [" green", " blue"], "answer": 1},
]
TASK = """task: toy
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_byte_tokenizer_ids_are_utf8_bytes(tmp_path):
    text = "héllo wörld\n\tx€ ~"
    tok = byte_tokenizer()
    assert len(tok) == 256 and tok(text)["input_ids"] == list(text.encode("utf-8"))
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == list(text.encode("utf-8")) and loaded.decode(list(text.encode())) == text


def own_loglikelihood(model, context, continuation):
    ids = torch.tensor(list((context + continuation).encode()))[None]  # [1, T]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.double(), -1)[0]  # [T, vocab]
    n = len(context.encode())
    return sum(logp[t - 1, ids[0, t]].item() for t in range(n, ids.shape[1]))


def test_lm_eval_runs_a_local_task_with_the_models_own_loglikelihoods(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from polyattn.hf.harness import main

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("polyattn", mixer=["gdn", "softmax"], num_hidden_layers=2, vocab_size=256, hidden_size=16,
                               mixer_config={"num_heads": 2}, init_std=0.5)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model_dir, task_dir, out = tmp_path / "model", tmp_path / "tasks", tmp_path / "out"
    model.save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    task_dir.mkdir()
    (task_dir / "toy.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (task_dir / "toy.yaml").write_text(TASK.format(data=task_dir / "toy.jsonl"))
    argv = ["polyattn-lm-eval", "run", "--model", "polyattn", "--model_args", f"pretrained={model_dir}",
            "--tasks", "toy", "--include_path", str(task_dir), "--output_path", str(out), "--log_samples"]
    monkeypatch.setattr(sys, "argv", argv)
    main()
    (samples_file,) = out.rglob("samples_toy_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    correct = 0
    for sample, doc in zip(sorted(samples, key=lambda s: s["doc_id"]), DOCS):
        theirs = [float(r[0][0]) for r in sample["resps"]]
        ours = [own_loglikelihood(model, doc["question"], " " + choice) for choice in doc["choices"]]
        assert theirs == pytest.approx(ours, rel=1e-5, abs=1e-4)
        correct += int(max(range(len(ours)), key=ours.__getitem__) == doc["answer"])
    (results_file,) = out.rglob("results_*.json")
    assert json.loads(results_file.read_text())["results"]["toy"]["acc,none"] == correct / len(DOCS)
