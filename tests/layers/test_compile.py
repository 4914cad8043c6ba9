"""``torch.compile(fullgraph=True)`` of every mixer's forward on CPU: no graph breaks (no host syncs in checks).

The ``eager`` backend traces with dynamo exactly as inductor would (a graph break fails ``fullgraph``)
without compiling kernels, so the test stays fast.
"""

import pytest
import torch

from polyattn.layers import MIXERS, build_mixer

POSITIONAL = ("loglinear-mamba2", "loglinear-gdn")  # decoding reads Fenwick positions on the host


def make(name):
    torch.manual_seed(0)
    return build_mixer(name, 16, num_heads=2)


@pytest.mark.parametrize("name", list(MIXERS))
def test_prefill_compiles_without_graph_breaks(name):
    mixer = make(name)
    x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = torch.compile(mixer, fullgraph=True, backend="eager")
    y, state = compiled(x, use_cache=True)
    y_eager, state_eager = mixer(x, use_cache=True)
    assert torch.equal(y, y_eager)
    assert state.position == state_eager.position == 11


@pytest.mark.parametrize("name", [n for n in MIXERS if n not in POSITIONAL])
def test_decode_step_compiles_without_graph_breaks(name):
    mixer = make(name)
    x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(1))
    _, state = mixer(x[:, :10], use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(mixer, fullgraph=True, backend="eager")
    y, _ = compiled(x[:, 10:], state, use_cache=True)
    assert torch.equal(y, mixer(x[:, 10:], state, use_cache=True)[0])
