"""Bad input to the first-order primitives raises ValueError saying what was expected and what came."""

import pytest
import torch

from polyattn import ops


def _ok(T=6):
    gen = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(1, T, 2, 4, generator=gen),
        k=torch.randn(1, T, 2, 4, generator=gen),
        v=torch.randn(1, T, 2, 3, generator=gen),
        g=-torch.rand(1, T, 2, generator=gen),
    )


def _call(op, **x):
    if op is ops.delta_rule:
        x.setdefault("beta", torch.rand(x["q"].shape[:3]))
    return op(**x)


BAD = {
    "q-rank": (lambda x: {**x, "q": x["q"][0]}, r"q: expected a 4-D tensor"),
    "k-mismatched-K": (lambda x: {**x, "k": x["k"][..., :3]}, r"k: expected shape \(1, 6, 2, 4\)"),
    "k-mismatched-T": (lambda x: {**x, "k": x["k"][:, :5]}, r"k: expected shape"),
    "v-mismatched-H": (lambda x: {**x, "v": x["v"][:, :, :1]}, r"v: expected shape \[B, T, H, V\] = \[1, 6, 2, V\]"),
    "v-mismatched-B": (lambda x: {**x, "v": torch.cat([x["v"], x["v"]])}, r"v: expected shape"),
    "dtype-mix": (lambda x: {**x, "v": x["v"].double()}, r"expected one dtype"),
    "int-dtype": (lambda x: {**x, "q": x["q"].long(), "k": x["k"].long(), "v": x["v"].long()}, r"expected a floating dtype"),
    "device-mix": (lambda x: {**x, "k": x["k"].to("meta")}, r"k: expected device cpu"),
    "g-positive": (lambda x: {**x, "g": x["g"].abs() + 0.1}, r"g: expected a log-decay g <= 0"),
    "g-positive-beside-nan": (lambda x: {**x, "g": torch.where(x["g"] < -0.5, float("nan"), 0.1)}, r"g: expected a log-decay g <= 0"),
    "g-shape": (lambda x: {**x, "g": x["g"][..., None]}, r"g: expected shape \[B, T, H\]"),
    "state-shape": (lambda x: {**x, "initial_state": torch.zeros(1, 2, 3, 4)}, r"initial_state: expected shape \[1, 2, 4, 3\]"),
    "cu-with-B2": (
        lambda x: {**{n: torch.cat([t, t]) for n, t in x.items()}, "cu_seqlens": torch.tensor([0, 6])},
        r"cu_seqlens: expected batch size B = 1",
    ),
    "cu-not-increasing": (lambda x: {**x, "cu_seqlens": torch.tensor([0, 4, 2, 6])}, r"strictly increasing"),
    "state-N-vs-cu": (
        lambda x: {**x, "cu_seqlens": torch.tensor([0, 2, 6]), "initial_state": torch.zeros(1, 2, 4, 3)},
        r"initial_state: expected shape \[2, 2, 4, 3\]",
    ),
    "scale-type": (lambda x: {**x, "scale": "0.5"}, r"scale: expected a Python float"),
}


@pytest.mark.parametrize("op", [ops.linear_attn, ops.delta_rule], ids=["linear_attn", "delta_rule"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises(op, case):
    make, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        _call(op, **make(_ok()))


@pytest.mark.parametrize(
    "beta, message",
    [
        (torch.rand(1, 6, 2, 1), r"beta: expected shape \[B, T, H\] = \[1, 6, 2\]"),
        (torch.rand(1, 5, 2), r"beta: expected shape"),
        (torch.rand(1, 6, 2).to("meta"), r"beta: expected device cpu"),
    ],
    ids=["extra-dim", "short-T", "device"],
)
def test_delta_rule_bad_beta(beta, message):
    with pytest.raises(ValueError, match=message):
        ops.delta_rule(**_ok(), beta=beta)


def test_unknown_impl():
    with pytest.raises(ValueError, match="impl must be"):
        ops.linear_attn(**_ok(), impl="cuda")
    with pytest.raises(NotImplementedError, match=r"delta_rule has no impl='scan'"):
        ops.delta_rule(**_ok(), beta=torch.rand(1, 6, 2), impl="scan")
