"""Bad input to ``ops.loglinear_attn`` raises ValueError (or NotImplementedError for a missing impl)."""

import pytest
import torch

from polyattn import ops
from polyattn.ops.loglinear import LOGLINEAR_ATTN_FORMS, LogLinearState


def _ok(T=6, L=4):
    gen = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(1, T, 2, 4, generator=gen),
        k=torch.randn(1, T, 2, 4, generator=gen),
        v=torch.randn(1, T, 2, 3, generator=gen),
        lam=torch.rand(1, T, 2, L, generator=gen),
        g=-torch.rand(1, T, 2, generator=gen),
    )


def _state(position, L=4, N=1):
    return LogLinearState(torch.zeros(N, 2, L, 4, 3), torch.tensor([position] * N))


BAD = {
    "lam-too-few-levels": (lambda x: {**x, "lam": x["lam"][..., :3]}, r"lam: expected at least num_levels\(6\) = 4 levels"),
    "lam-too-few-with-state": (
        lambda x: {**x, "initial_state": _state(3)},
        r"lam: expected at least num_levels\(9\) = 5 levels .* got L = 4",
    ),
    "lam-too-few-varlen": (
        lambda x: {**x, "cu_seqlens": torch.tensor([0, 1, 6]), "initial_state": _state(4, N=2)},
        r"num_levels\(9\) = 5",
    ),
    "lam-shape": (lambda x: {**x, "lam": x["lam"][:, :5]}, r"lam: expected shape \[B, T, H, L\]"),
    "beta-shape": (lambda x: {**x, "beta": torch.rand(1, 6, 2, 1)}, r"beta: expected shape \[B, T, H\]"),
    "g-positive": (lambda x: {**x, "g": x["g"].abs() + 0.1}, r"g: expected a log-decay g <= 0"),
    "state-not-a-pair": (lambda x: {**x, "initial_state": torch.zeros(1, 2, 4, 4, 3)}, r"expected LogLinearState"),
    "state-levels-vs-lam": (
        lambda x: {**x, "initial_state": _state(0, L=5)},
        r"initial_state.levels: expected shape \[1, 2, 4, 4, 3\]",
    ),
    "state-position-dtype": (
        lambda x: {**x, "initial_state": LogLinearState(torch.zeros(1, 2, 4, 4, 3), torch.tensor([0.0]))},
        r"initial_state.position: expected an int64 tensor \[1\]",
    ),
    "state-position-negative": (lambda x: {**x, "initial_state": _state(-1)}, r"expected positions >= 0"),
    "cu-with-B2": (
        lambda x: {**{n: torch.cat([t, t]) for n, t in x.items()}, "cu_seqlens": torch.tensor([0, 6])},
        r"cu_seqlens: expected batch size B = 1",
    ),
    "impl-unknown": (lambda x: {**x, "impl": "fast"}, r"impl must be 'auto' or one of"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises(case):
    make, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        ops.loglinear_attn(**make(_ok()))


@pytest.mark.parametrize("form", list(LOGLINEAR_ATTN_FORMS))
def test_forms_check_the_level_count_themselves(form):
    x = _ok()
    with pytest.raises(ValueError, match=r"lam: expected at least num_levels\(11\) = 5"):
        LOGLINEAR_ATTN_FORMS[form](**x, scale=1.0, initial_state=_state(5))


def test_chunk_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="chunk_size: expected a power of two, got 6"):
        LOGLINEAR_ATTN_FORMS["chunk"](**_ok(), scale=1.0, chunk_size=6)


def test_missing_impl_names_the_available_ones():
    with pytest.raises(NotImplementedError, match=r"loglinear_attn has no impl='parallel'; it has \['chunk', 'naive', 'recurrent', 'scan', 'triton'\]"):
        ops.loglinear_attn(**_ok(), impl="parallel")
