"""Every mixer under a NaN or Inf in a future input token (the `polyattn.layers` docstring, "Non-finite input").

Every mixer keeps every earlier output bit-identical to a clean run: one sequence, packed documents
(the earlier documents and the planted one's earlier tokens) and a continuation from a cache. Mixers
that compute a log-decay from the input make it NaN there, which the ops take as non-finite input.
"""

import pytest
import torch

from polyattn.layers import MIXERS, build_mixer

T, PLANTS = 150, [(value, p) for value in ("nan", "inf") for p in (64, 100)]


def make(name):
    torch.manual_seed(0)
    return build_mixer(name, 16, num_heads=2).double()


def planted(x, value, p):
    x = x.clone()
    x[:, p, 3] = float(value)
    return x


@pytest.mark.parametrize("name", list(MIXERS))
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
