import pytest
import torch

from polyattn.ops.common import (
    associative_scan,
    check_cu_seqlens,
    combine_decayed,
    exp_segsum,
    pad_time,
    resolve_impl,
    segsum,
    to_chunks,
)
from polyattn.testing import assert_close_rel, low_precision_errors


def test_segsum_matches_definition():
    x = -torch.rand(2, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = segsum(x)
    for t in range(9):
        for s in range(9):
            want = x[:, s + 1 : t + 1].sum(-1) if s <= t else torch.full((2,), float("-inf"), dtype=torch.float64)
            # the same terms summed in another order: a few ulps of sums up to 8, ~1e-15 each
            assert torch.equal(out[:, t, s], want) or torch.allclose(out[:, t, s], want, rtol=0, atol=1e-14)
    assert torch.equal(exp_segsum(x), torch.exp(out))


def test_segsum_short_segments_stay_exact_on_long_sequences():
    # A difference of two long prefix sums would lose the small segment; the masked cumsum does not.
    x = torch.full((4096,), -1.0, dtype=torch.float32)
    x[-2:] = -1e-3
    assert segsum(x)[-1, -2].item() == pytest.approx(-1e-3, rel=1e-6)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 13])
def test_associative_scan_equals_sequential(n):
    gen = torch.Generator().manual_seed(n)
    a = -torch.rand(3, n, generator=gen, dtype=torch.float64)
    S = torch.randn(3, n, 4, 2, generator=gen, dtype=torch.float64)
    a_scan, S_scan = associative_scan(combine_decayed, (a, S), dim=1)
    acc_a, acc_S = a[:, 0], S[:, 0]
    for i in range(n):
        if i:
            acc_a, acc_S = combine_decayed((acc_a, acc_S), (a[:, i], S[:, i]))
        assert_close_rel(S_scan[:, i], acc_S, 1e-14)
        assert_close_rel(a_scan[:, i], acc_a, 1e-14)


def test_combine_is_associative():
    gen = torch.Generator().manual_seed(0)
    x, y, z = ((-torch.rand(2, generator=gen, dtype=torch.float64), torch.randn(2, 3, 3, generator=gen, dtype=torch.float64)) for _ in range(3))
    left = combine_decayed(combine_decayed(x, y), z)
    right = combine_decayed(x, combine_decayed(y, z))
    assert_close_rel(left[1], right[1], 1e-14)


def test_pad_and_chunk():
    x = torch.arange(2 * 7 * 3, dtype=torch.float64).reshape(2, 7, 3)
    p = pad_time(x, 4)
    assert p.shape == (2, 8, 3) and torch.equal(p[:, :7], x) and torch.equal(p[:, 7], torch.zeros(2, 3, dtype=torch.float64))
    assert to_chunks(p, 4).shape == (2, 2, 4, 3)
    assert pad_time(None, 4) is None
    with pytest.raises(ValueError, match="multiple of the chunk size"):
        to_chunks(x, 4)


def test_resolve_impl():
    forms = {"naive": len, "chunk": abs}
    q = torch.zeros(1)
    assert resolve_impl("op", "auto", forms, q) is abs
    assert resolve_impl("op", "naive", forms, q) is len
    with pytest.raises(NotImplementedError, match=r"op has no impl='scan'; it has \['chunk', 'naive'\]"):
        resolve_impl("op", "scan", forms, q)
    with pytest.raises(ValueError, match="impl must be"):
        resolve_impl("op", "fast", forms, q)


def test_auto_picks_triton_only_for_cuda_non_float64():
    forms = {"chunk": abs, "triton": len}
    assert resolve_impl("op", "auto", forms, torch.zeros(1, device="meta")) is abs
    assert resolve_impl("op", "auto", forms, torch.zeros(1)) is abs


@pytest.mark.parametrize(
    "cu, message",
    [
        ([0, 3, 3, 8], "strictly increasing"),
        ([0, 5, 3, 8], "strictly increasing"),
        ([1, 4, 8], "start at 0"),
        ([0, 4, 7], "end at T = 8"),
        ([0], "N >= 1"),
    ],
    ids=["empty-seq", "decreasing", "bad-start", "bad-end", "too-short"],
)
def test_cu_seqlens_rejected(cu, message):
    q = torch.zeros(1, 8, 1, 2)
    with pytest.raises(ValueError, match=message):
        check_cu_seqlens(torch.tensor(cu), q)


def test_cu_seqlens_dtype_and_batch():
    q = torch.zeros(1, 8, 1, 2)
    assert check_cu_seqlens(torch.tensor([0, 1, 8]), q) == 2
    with pytest.raises(ValueError, match="dtype int64"):
        check_cu_seqlens(torch.tensor([0.0, 8.0]), q)
    with pytest.raises(ValueError, match="B = 1"):
        check_cu_seqlens(torch.tensor([0, 8]), torch.zeros(2, 8, 1, 2))


@pytest.mark.parametrize("fast_noise, passes", [(1e-9, True), (1e-3, False)])
def test_low_precision_bound_of_a_tensor_that_is_zero_to_rounding(fast_noise, passes):
    """An output whose float64 reference is zero to rounding (1e-17 of the call's scale) is judged on
    that scale: fp32 noise passes, an error of 1e-3 of the scale fails (a relative error would fail both)."""
    x = {"q": torch.randn(1, 4, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))}
    x["v"] = x["q"]

    def form(noise):
        def run(q, v, *, scale, initial_state, output_final_state):
            return noise * q.to(q.dtype), q.sum(1)  # o ~ noise, the final state O(1): the call's scale
        return run

    err, bound = low_precision_errors(form(1e-17), form(1e-9), form(fast_noise), x, None, torch.float32)["o"]
    assert (err <= bound) == passes, (err, bound)
