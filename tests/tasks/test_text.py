"""The ``text`` task: sources, held-out splits, tokenizers, windows, and a training run on a small corpus."""

import json

import pytest
import torch

from polyattn.cli import main
from polyattn.tasks import make_task
from polyattn.tasks.text import BYTE_VOCAB, stdlib_files, text
from polyattn.train import TrainConfig, train

LETTERS = "ABCDEFGHIJKL"


@pytest.fixture
def corpus(tmp_path):
    """Twelve files, file i holding only letter i: file 9 ('J') is the held-out one."""
    for i, letter in enumerate(LETTERS):
        (tmp_path / f"doc{i:02d}.txt").write_text(letter * 300)
    return tmp_path


def test_folder_holds_out_every_tenth_file(corpus):
    train_data = make_task("text", 50, 16, 0, seed=1, source=str(corpus))
    val = text(50, 16, seed=1, source=str(corpus), split="validation")
    train_chars = set(bytes(train_data.inputs.flatten().tolist()).decode())
    assert train_chars <= set(LETTERS.replace("J", "") + "\n") and len(train_chars) > 3
    assert set(bytes(val.inputs.flatten().tolist()).decode()) == {"J"}
    assert torch.equal(train_data.inputs[:, 1:], train_data.labels[:, :-1])  # labels are the next tokens
    assert train_data.inputs.shape == (50, 16) and train_data.labels.max() < BYTE_VOCAB
    assert torch.equal(train_data.inputs, text(50, 16, seed=1, source=str(corpus)).inputs)  # seeded


def test_single_file_holds_out_its_last_tenth(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("a" * 900 + "b" * 100)
    assert set(bytes(text(20, 8, source=str(path)).inputs.flatten().tolist())) == {ord("a")}
    assert set(bytes(text(20, 8, source=str(path), split="validation").inputs.flatten().tolist())) == {ord("b")}


def test_stdlib_corpus_is_the_interpreters_own_source():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    data = text(4, 64, seed=0)
    assert data.inputs.shape == (4, 64)


def test_transformers_tokenizer_by_directory(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{c * n: 1 + i * 3 + n - 1 for i, c in enumerate(LETTERS) for n in (1, 2, 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)
    data = text(10, 4, source=str(corpus), tokenizer=str(directory), vocab_size=64)
    assert data.inputs.max() < len(vocab)
    with pytest.raises(ValueError, match="at least the tokenizer's"):
        text(10, 4, source=str(corpus), tokenizer=str(directory), vocab_size=8)


def test_datasets_source_reads_the_text_column_of_its_splits(tmp_path, monkeypatch):
    """A local `datasets` folder (no network): train.txt and validation.txt become the two splits."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "train.txt").write_text("a" * 80 + "\n" + "b" * 80 + "\n")
    (tmp_path / "validation.txt").write_text("c" * 80 + "\n")
    source = f"datasets:{tmp_path}"
    assert set(bytes(text(20, 8, source=source).inputs.flatten().tolist())) <= set(b"ab\n")
    assert set(bytes(text(20, 8, source=source, split="validation").inputs.flatten().tolist())) <= set(b"c\n")
    only_train = tmp_path / "only-train"
    only_train.mkdir()
    (only_train / "train.txt").write_text("x" * 40)
    with pytest.raises(ValueError, match="expected a split among"):
        text(2, 8, source=f"datasets:{only_train}", split="validation")


def test_bad_sources_raise(tmp_path):
    with pytest.raises(ValueError, match="expected 'stdlib', a file, a folder or 'datasets:NAME'"):
        text(1, 4, source=str(tmp_path / "missing"))
    (tmp_path / "tiny.txt").write_text("abc")
    with pytest.raises(ValueError, match="expected at least 5 tokens"):
        text(1, 4, source=str(tmp_path / "tiny.txt"), split="validation")
    with pytest.raises(ValueError, match="split must be one of"):
        text(1, 4, source=str(tmp_path / "tiny.txt"), split="test")


def test_training_on_text_reports_loss_per_position(corpus, tmp_path):
    out = tmp_path / "run"
    config = TrainConfig(task="text", task_options={"source": str(corpus)}, train_segments=[(32, 64, 0)],
                         test_segments=[(32, 16, 0)], mixer="gdn", mixer_config={"num_heads": 2}, d_model=16,
                         steps=3, batch_size=8, device="cpu", out_dir=str(out))
    result, _ = train(config, quiet=True)
    (row,) = result["eval"]
    assert len(row["loss_by_position"]) == 32 and all(x is not None for x in row["loss_by_position"])
    assert row["loss"] == pytest.approx(sum(row["loss_by_position"]) / 32)
    assert json.loads((out / "results.json").read_text())["eval"][0]["loss"] == row["loss"]
    assert (out / "loss_by_position.png").stat().st_size > 0


def test_cli_trains_on_text(corpus, tmp_path, capsys):
    argv = ["train", "--task", "text", "--task-options", json.dumps({"source": str(corpus)}), "--mixer", "linear",
            "--train", "16:32:0", "--test", "16:8:0", "--d-model", "16", "--steps", "2", "--batch-size", "4",
            "--out", str(tmp_path / "cli")]
    assert main(argv) == 0
    assert len(json.loads((tmp_path / "cli" / "results.json").read_text())["eval"][0]["loss_by_position"]) == 16
    printed = capsys.readouterr().out
    for name in ("results.json", "loss_by_position.png", "checkpoint"):
        assert f"wrote {tmp_path / 'cli' / name}\n" in printed
