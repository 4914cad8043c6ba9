"""Every mixer under a NaN or Inf in a future input token (the `polyattn.layers` docstring, "Non-finite input").

Mixers without a learned decay keep every earlier output bit-identical to a clean run: one sequence,
packed documents (the earlier documents and the planted one's earlier tokens) and a continuation
from a cache. Mixers that compute a log-decay from the input make it NaN there, which the op's value
check rejects: a ValueError on CPU.
"""

import pytest
import torch

from polyattn.layers import MIXERS, build_mixer

GATED = ("mamba2", "gdn", "hla2", "ahla", "hla3", "loglinear-mamba2", "loglinear-gdn")
T, PLANTS = 150, [(value, p) for value in ("nan", "inf") for p in (64, 100)]


def make(name):
    torch.manual_seed(0)
    return build_mixer(name, 16, num_heads=2).double()


def planted(x, value, p):
    x = x.clone()
    x[:, p, 3] = float(value)
    return x


@pytest.mark.parametrize("name", [n for n in MIXERS if n not in GATED])
def test_future_nonfinite_input_leaves_earlier_outputs_bit_identical(name):
    mixer = make(name)
    x = torch.randn(1, T, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cu = torch.tensor([0, 50, 90, T])
    with torch.no_grad():
        clean, packed_clean = mixer(x)[0], mixer(x, cu_seqlens=cu)[0]
        _, state = mixer(x[:, :50], use_cache=True)
        continued_clean = mixer(x[:, 50:], state, use_cache=True)[0]
        for value, p in PLANTS:
            xp = planted(x, value, p)
            y = mixer(xp)[0]
            assert torch.equal(y[:, :p], clean[:, :p]), f"{value} at {p} changed an earlier output"
            assert not bool(torch.isfinite(y[:, p:]).all()), f"{value} at {p} never reached an output"
            assert torch.equal(mixer(xp, cu_seqlens=cu)[0][:, :p], packed_clean[:, :p]), f"packed: {value} at {p}"
            continued = mixer(xp[:, 50:], state, use_cache=True)[0]
            assert torch.equal(continued[:, : p - 50], continued_clean[:, : p - 50]), f"from a cache: {value} at {p}"


@pytest.mark.parametrize("name", GATED)
def test_nonfinite_input_to_a_learned_decay_is_rejected(name):
    x = torch.randn(1, T, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad(), pytest.raises(ValueError, match=r"g: expected a log-decay g <= 0 everywhere"):
        make(name)(planted(x, "nan", 100))
