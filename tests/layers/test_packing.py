"""Packed (`cu_seqlens`) and padded (`attention_mask`) batches: every mixer gives each sequence exactly what
it gets alone, forward and gradients, in float64; packed and padded states continue each sequence."""

import pytest
import torch

from polyattn.layers import MIXERS, build_mixer
from polyattn.testing import assert_close_rel

D_MODEL = 16
LENGTHS = [5, 1, 9, 3, 7]  # shorter than the conv kernel, a single token, longer ones


def make(name):
    torch.manual_seed(0)
    return build_mixer(name, D_MODEL, num_heads=2).double()


def sequences(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, D_MODEL, dtype=torch.float64, generator=gen) for n in LENGTHS]


def weights_like(y, seed=2):
    return torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(seed))


def alone(mixer, xs, use_cache=False):
    """Each sequence run by itself: outputs, input gradients, parameter gradients (of Σ w·y), states."""
    outs, grads, states = [], [], []
    mixer.zero_grad()
    for i, x in enumerate(xs):
        x = x.clone().requires_grad_()
        y, state = mixer(x, use_cache=use_cache)
        (y * weights_like(y, seed=10 + i)).sum().backward()
        outs.append(y.detach())
        grads.append(x.grad)
        states.append(state)
    return outs, grads, [p.grad.clone() for p in mixer.parameters()], states


def assert_params_grads(mixer, expected, name):
    for p, e in zip(mixer.parameters(), expected):
        assert_close_rel(p.grad, e, 1e-9, f"{name} parameter gradient")


@pytest.mark.parametrize("name", list(MIXERS))
def test_packed_documents_equal_each_alone(name):
    mixer = make(name)
    xs = sequences()
    outs, grads, param_grads, _ = alone(mixer, xs)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    x = torch.cat(xs, dim=1).requires_grad_()
    mixer.zero_grad()
    y, _ = mixer(x, cu_seqlens=cu_seqlens)
    pieces = y.split(LENGTHS, dim=1)
    sum((p * weights_like(p, seed=10 + i)).sum() for i, p in enumerate(pieces)).backward()
    for i, (piece, out, g_in, g) in enumerate(zip(pieces, outs, x.grad.split(LENGTHS, dim=1), grads)):
        assert_close_rel(piece, out, 1e-9, f"{name} document {i}")
        assert_close_rel(g_in, g, 1e-9, f"{name} document {i} input gradient")
    assert_params_grads(mixer, param_grads, name)


def padded_batch(xs, left=True, seed=3):
    """Rows padded to the longest with large garbage (never zeros) where the mask is 0."""
    T = max(x.shape[1] for x in xs)
    gen = torch.Generator().manual_seed(seed)
    batch = 100 * torch.randn(len(xs), T, D_MODEL, dtype=torch.float64, generator=gen)
    mask = torch.zeros(len(xs), T, dtype=torch.long)
    for i, x in enumerate(xs):
        n = x.shape[1]
        span = slice(T - n, T) if left else slice(0, n)
        batch[i, span] = x[0]
        mask[i, span] = 1
    return batch, mask


@pytest.mark.parametrize("left", [True, False], ids=["left-padded", "right-padded"])
@pytest.mark.parametrize("name", list(MIXERS))
def test_padded_rows_equal_each_alone(name, left):
    mixer = make(name)
    xs = sequences()
    outs, grads, param_grads, _ = alone(mixer, xs)
    batch, mask = padded_batch(xs, left)
    x = batch.clone().requires_grad_()
    mixer.zero_grad()
    y, _ = mixer(x, attention_mask=mask)
    keep = mask.bool()
    loss = 0
    for i in range(len(xs)):
        loss = loss + (y[i][keep[i]][None] * weights_like(outs[i], seed=10 + i)).sum()
    loss.backward()
    for i in range(len(xs)):
        assert_close_rel(y[i][keep[i]][None], outs[i], 1e-9, f"{name} row {i}")
        assert_close_rel(x.grad[i][keep[i]][None], grads[i], 1e-9, f"{name} row {i} input gradient")
    assert bool((y.detach()[~keep] == 0).all()), f"{name}: nonzero outputs at padding"
    assert bool((x.grad[~keep] == 0).all()), f"{name}: gradient reaches the padding"
    assert_params_grads(mixer, param_grads, name)


@pytest.mark.parametrize("name", list(MIXERS))
def test_packed_and_padded_states_continue_each_sequence(name):
    """Prefill packed (one state per document) or left-padded, then one-token steps == each sequence alone."""
    mixer = make(name)
    xs = sequences()
    steps = torch.randn(len(xs), 3, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = []
        for i, x in enumerate(xs):
            _, state = mixer(x, use_cache=True)
            ys = []
            for t in range(steps.shape[1]):
                y, state = mixer(steps[i : i + 1, t : t + 1], state, use_cache=True)
                ys.append(y)
            expected.append(torch.cat(ys, dim=1))
        expected = torch.cat(expected)  # [N, 3, d_model]
        cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
        _, packed_state = mixer(torch.cat(xs, dim=1), use_cache=True, cu_seqlens=cu_seqlens)
        batch, mask = padded_batch(xs)
        _, padded_state = mixer(batch, use_cache=True, attention_mask=mask)
        assert padded_state.position == batch.shape[1]
        for label, state in (("packed", packed_state), ("left-padded", padded_state)):
            ys = []
            for t in range(steps.shape[1]):
                y, state = mixer(steps[:, t : t + 1], state, use_cache=True, attention_mask=torch.ones(len(xs), 1))
                ys.append(y)
            assert_close_rel(torch.cat(ys, dim=1), expected, 1e-9, f"{name} {label}")


def test_packing_and_padding_bad_input_raises():
    mixer = make("linear")
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    with pytest.raises(ValueError, match="batch size B = 1"):
        mixer(x, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="end at T = 6"):
        mixer(x[:1], cu_seqlens=torch.tensor([0, 5]))
    _, state = mixer(x[:1], use_cache=True)
    with pytest.raises(ValueError, match="expected state=None"):
        mixer(x[:1], state, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="or cu_seqlens .packed documents., got both"):
        mixer(x[:1], attention_mask=torch.ones(1, 6), cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(2, 6\)"):
        mixer(x, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="at least one token"):
        mixer(x, attention_mask=torch.tensor([[1] * 6, [0] * 6]))
    _, state = mixer(x, use_cache=True)
    with pytest.raises(ValueError, match="expected all ones with a state"):
        mixer(x[:, :1], state, attention_mask=torch.tensor([[1], [0]]))
