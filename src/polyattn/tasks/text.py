"""``text``: next-token prediction on real text (language modelling), in the `TaskData` layout.

Sources (``source=``): ``"stdlib"`` (the default: the running interpreter's standard-library ``.py``
files, a real corpus every machine has, no network), a text file, a folder (every file below it,
sorted), or ``"datasets:NAME"``, a Hugging Face `datasets` name or local dataset folder (its ``"text"``
column; needs the ``datasets`` package, and a network for hub names). Held-out data for
``split="validation"``: every tenth file of the sorted list (files 9, 19, ...); a single file gives its
last tenth; a dataset its ``validation`` split (else ``test``). Tokenizers (``tokenizer=``): ``"byte"`` (UTF-8 bytes, ids
0-255, vocabulary 256) or any `transformers` tokenizer name or directory (`AutoTokenizer`).

An example is a window of ``seq_len + 1`` tokens at a seeded random offset of the split's token
stream (documents joined in file order): ``inputs = w[:-1]``, ``labels = w[1:]``, every position scored
(``num_pairs`` is unused; the training loop reports the loss at every position).

    tokens    h  e  l  l  o  _  w  o  r  l  d
    inputs    h  e  l  l  o  _  w  o  r  l        (seq_len = 10)
    labels    e  l  l  o  _  w  o  r  l  d
"""

import functools
import sysconfig
from pathlib import Path

import torch

from polyattn.tasks.common import TaskData, generator

BYTE_VOCAB = 256
VALIDATION_EVERY = 10
SPLITS = ("train", "validation")
DATASETS_PREFIX = "datasets:"


def stdlib_files():
    """The interpreter's standard-library ``.py`` files (installed packages left out), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [f for f in sorted(root.rglob("*.py")) if not {"site-packages", "dist-packages"} & set(f.parts)]


def source_files(source):
    if source == "stdlib":
        return stdlib_files()
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        return [f for f in sorted(path.rglob("*")) if f.is_file()]
    raise ValueError(f"text source: expected 'stdlib', a file, a folder or 'datasets:NAME', got {source!r} (not found)")


def dataset_texts(name, split):
    """The ``text`` column of a `datasets` split (validation: ``validation``, else ``test``)."""
    import datasets

    splits = datasets.load_dataset(name)
    wanted = ["train"] if split == "train" else ["validation", "test"]
    found = [s for s in wanted if s in splits]
    if not found:
        raise ValueError(f"dataset {name!r}: expected a split among {wanted}, got {list(splits)}")
    data = splits[found[0]]
    if "text" not in data.column_names:
        raise ValueError(f"dataset {name!r}: expected a 'text' column, got {data.column_names}")
    return list(data["text"])


def split_texts(source, split):
    """The split's documents: held-out files for validation, or a single file's last tenth."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if source.startswith(DATASETS_PREFIX):
        return dataset_texts(source[len(DATASETS_PREFIX) :], split)
    files = source_files(source)
    if not files:
        raise ValueError(f"text source {source!r}: expected at least one file, found none")
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    if len(texts) == 1:
        cut = len(texts[0]) - len(texts[0]) // VALIDATION_EVERY
        return [texts[0][:cut]] if split == "train" else [texts[0][cut:]]
    held_out = [i % VALIDATION_EVERY == VALIDATION_EVERY - 1 for i in range(len(texts))]
    return [t for t, h in zip(texts, held_out) if h == (split == "validation")]


def tokenize(texts, tokenizer):
    """Token ids of the joined documents: ``[n]`` int64, and the vocabulary size."""
    if tokenizer == "byte":
        data = bytearray("\n".join(texts).encode("utf-8"))
        ids = torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)  # [n]
        return ids.long(), BYTE_VOCAB
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    ids = [i for text in texts for i in tok(text, add_special_tokens=False)["input_ids"]]
    return torch.tensor(ids, dtype=torch.long), len(tok)


@functools.lru_cache(maxsize=8)
def token_stream(source, tokenizer, split):
    """The split's token ids (cached: every segment of a run reads the same stream)."""
    return tokenize(split_texts(source, split), tokenizer)


def text(num_examples, seq_len, num_pairs=0, *, seed=0, vocab_size=BYTE_VOCAB, source="stdlib", tokenizer="byte", split="train"):
    """`num_examples` windows of `seq_len` tokens from the split (module docstring)."""
    stream, tokenizer_vocab = token_stream(str(source), tokenizer, split)
    if vocab_size < tokenizer_vocab:
        raise ValueError(f"vocab_size: expected at least the tokenizer's {tokenizer_vocab}, got {vocab_size}")
    if stream.numel() < seq_len + 1:
        raise ValueError(f"text source {source!r} ({split}): expected at least {seq_len + 1} tokens, got {stream.numel()}")
    starts = torch.randint(stream.numel() - seq_len, (num_examples,), generator=generator(seed))  # [N]
    windows = stream[starts[:, None] + torch.arange(seq_len + 1)]  # [N, seq_len + 1]
    return TaskData(inputs=windows[:, :-1], labels=windows[:, 1:], length=seq_len, pairs=0)
