"""Synthetic tasks: invariants checked by brute force against the token layout, determinism, gap law."""

import pytest
import torch

from polyattn.tasks import IGNORE_INDEX, TASKS, induction, make_task, mqar, niah_uuid, overwrite
from polyattn.tasks.common import power_law_log_weights
from polyattn.tasks.niah import ANSWER, NEEDLE, QUERY


def bindings(row, context):
    """``[(key, value)]`` from the write block ``k v k v ...`` of one example."""
    return [(int(row[i]), int(row[i + 1])) for i in range(0, context, 2)]


@pytest.mark.parametrize("T, P, noise", [(64, 4, True), (128, 16, False), (256, 64, True)], ids=["T64-P4", "T128-P16-clean", "T256-P64"])
def test_mqar_layout_and_labels(T, P, noise):
    V = 512
    data = mqar(50, T, P, vocab_size=V, random_non_queries=noise, seed=3)
    assert data.inputs.shape == data.labels.shape == (50, T) and (data.length, data.pairs) == (T, P)
    for row, lab in zip(data.inputs, data.labels):
        kv = dict(bindings(row, 2 * P))
        assert len(kv) == P, "keys unique per example"
        assert all(1 <= k < V // 2 <= v < V for k, v in kv.items())
        assert len(set(kv.values())) == P
        scored = (lab != IGNORE_INDEX).nonzero().flatten().tolist()
        assert len(scored) == P and all(t >= 2 * P and (t - 2 * P) % 2 == 0 for t in scored)
        assert sorted(int(row[t]) for t in scored) == sorted(kv), "every key queried once, at the labels"
        assert all(int(lab[t]) == kv[int(row[t])] for t in scored), "label = bound value"
        if not noise:
            unscored = [t for t in range(2 * P, T) if t not in scored]
            assert all(int(row[t]) == 0 for t in unscored)


def test_mqar_gaps_follow_the_power_law():
    """Zoology's law P(gap = i) ∝ i^(a−1): compare the empirical first-slot frequency with the law's."""
    T, P, a, N = 64, 1, 0.3, 20000
    data = mqar(N, T, P, vocab_size=64, power_a=a, random_non_queries=False, seed=0)
    pos = (data.labels != IGNORE_INDEX).float().argmax(dim=1)  # [N]
    gaps = (pos - 2 * P) // 2  # [N] in [0, space)
    space = (T - 2 * P) // 2
    law = torch.softmax(power_law_log_weights(space, a), 0)  # [space]
    freq = torch.bincount(gaps, minlength=space).double() / N
    tol = 4 * torch.sqrt(law * (1 - law) / N) + 1e-3  # 4 sigma
    assert ((freq - law).abs() <= tol).all()
    assert freq[0] > freq[space // 2] > 0


def test_mqar_default_gaps_are_mostly_short():
    data = mqar(2000, 256, 8, vocab_size=512, random_non_queries=False, seed=1)
    pos = (data.labels != IGNORE_INDEX).nonzero()[:, 1]
    gaps = (pos - 16) // 2
    assert (gaps < 30).float().mean() > 0.5 and gaps.max() > 60


@pytest.mark.parametrize("name", list(TASKS))
def test_deterministic_by_seed(name):
    pairs = 1 if name == "induction" else 4
    a, b, c = (make_task(name, 8, 128, pairs, seed=s) for s in (5, 5, 6))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.inputs, c.inputs)


def test_overwrite_labels_are_the_latest_binding():
    P, U = 6, 5
    data = overwrite(100, 128, P, num_updates=U, vocab_size=256, seed=2)
    rewritten = 0
    for row, lab in zip(data.inputs, data.labels):
        writes = bindings(row, 2 * (P + U))
        latest = {}
        for k, v in writes:
            rewritten += k in latest
            latest[k] = v
        assert len(latest) == P and len({v for _, v in writes}) == P + U
        scored = (lab != IGNORE_INDEX).nonzero().flatten().tolist()
        assert sorted(int(row[t]) for t in scored) == sorted(latest)
        assert all(int(lab[t]) == latest[int(row[t])] for t in scored)
    assert rewritten == 100 * U


def test_induction_label_is_the_token_after_the_first_trigger():
    data = induction(200, 32, vocab_size=20, seed=4)
    for row, lab in zip(data.inputs, data.labels):
        triggers = (row == 0).nonzero().flatten().tolist()
        assert len(triggers) == 2 and triggers[1] == 31
        assert (lab != IGNORE_INDEX).sum() == 1 and int(lab[-1]) == int(row[triggers[0] + 1])


def test_niah_labels_spell_the_queried_needle():
    D = 8
    data = niah_uuid(100, 200, 3, uuid_len=D, vocab_size=256, seed=7)
    for row, lab in zip(data.inputs, data.labels):
        starts = (row == NEEDLE).nonzero().flatten().tolist()
        assert len(starts) == 3
        needles = {int(row[s + 1]): row[s + 2 : s + 2 + D].tolist() for s in starts}
        assert int(row[-D - 3]) == QUERY and int(row[-D - 1]) == ANSWER
        digits = needles[int(row[-D - 2])]
        scored = (lab != IGNORE_INDEX).nonzero().flatten().tolist()
        assert scored == list(range(200 - D - 1, 200 - 1))
        assert lab[scored].tolist() == digits == row[-D:].tolist()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: mqar(2, 32, 9), "seq_len"),
        (lambda: mqar(2, 63, 4), "even seq_len"),
        (lambda: mqar(2, 256, 40, vocab_size=64), "vocab_size"),
        (lambda: induction(2, 16, 2), "num_pairs == 1"),
        (lambda: niah_uuid(2, 20, 4), "seq_len"),
        (lambda: make_task("nope", 2, 16, 1), "unknown task"),
    ],
    ids=["too-many-pairs", "odd-length", "small-vocab", "induction-pairs", "niah-short", "unknown-task"],
)
def test_invalid_task_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
