"""`torch.compile(fullgraph=True)` of every mixer on CPU: one graph (no breaks), equal to eager forward and
backward; an inductor-compiled mixer, forward and backward, equals eager to rounding; compiled decay
checks still fire; a decoding step (log-linear included) and a packed forward (all but log-linear) compile
without breaks too."""

import pytest
import torch
import torch.nn.functional as F

from polyattn import ops
from polyattn.layers import MIXERS, build_mixer
from polyattn.layers.common import softplus
from polyattn.testing import assert_close_rel

def make(name):
    torch.manual_seed(0)
    return build_mixer(name, 16, num_heads=2)


def forward_and_grads(mixer, fn, x):
    x = x.clone().requires_grad_()
    mixer.zero_grad()
    y, _ = fn(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, [p.grad.clone() for p in mixer.parameters()]


def assert_all_close(got, want, rtol, name):
    for g, w in zip(got, want):
        for a, b in zip(g if isinstance(g, list) else [g], w if isinstance(w, list) else [w]):
            assert_close_rel(a, b, rtol, name)


@pytest.mark.parametrize("name", list(MIXERS))
def test_fullgraph_compile_equals_eager(name):
    """Dynamo traces each mixer as one graph; forward and backward equal eager exactly (eager backend), and
    the AOT-traced forward and backward (aot_eager: the eager kernels on the traced graphs) equal it to rounding."""
    mixer = make(name)
    x = torch.randn(2, 19, 16, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    traced = torch.compile(mixer, fullgraph=True, backend="eager")
    assert_all_close(forward_and_grads(mixer, traced, x), forward_and_grads(mixer, mixer, x), 0.0, name)
    torch._dynamo.reset()
    aot = torch.compile(mixer, fullgraph=True, backend="aot_eager")
    assert_all_close(forward_and_grads(mixer, aot, x), forward_and_grads(mixer, mixer, x), 1e-6, f"{name} aot_eager")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softplus_matches_float64(dtype):
    """The layers' softplus (written so that aot_eager can differentiate it) is log(1 + e^x) to rounding, with
    the gradient sigmoid(x), from far below 0 to far above (where torch's threshold of 20 returns x itself)."""
    x = torch.cat([torch.linspace(-60, 60, 2001, dtype=dtype), torch.tensor([-1e4, 1e4], dtype=dtype)]).requires_grad_()
    y = softplus(x)
    (dx,) = torch.autograd.grad(y.sum(), x)
    exact = x.detach().double()
    want = torch.cat([F.softplus(exact[:-2], threshold=100.0), torch.tensor([0.0, 1e4], dtype=torch.float64)])
    assert_close_rel(y.double(), want, 4 * torch.finfo(dtype).eps, "softplus")
    assert_close_rel(dx.double(), torch.sigmoid(exact), 4 * torch.finfo(dtype).eps, "softplus gradient")


def test_inductor_compile_equals_eager():
    torch._dynamo.reset()
    mixer = make("gdn")
    x = torch.randn(2, 19, 16, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(mixer, fullgraph=True)
    assert_all_close(forward_and_grads(mixer, compiled, x), forward_and_grads(mixer, mixer, x), 1e-5, "gdn inductor")


def test_compiled_decay_check_still_fires():
    torch._dynamo.reset()
    q = torch.randn(1, 5, 2, 4)
    g = -torch.rand(1, 5, 2)
    compiled = torch.compile(lambda q, g: ops.linear_attn(q, q, q, g)[0], fullgraph=True, backend="aot_eager")
    assert_close_rel(compiled(q, g), ops.linear_attn(q, q, q, g)[0], 1e-6, "compiled linear_attn")
    with pytest.raises(RuntimeError, match="log-decay g <= 0"):
        compiled(q, g.abs() + 0.1)


@pytest.mark.parametrize("name", list(MIXERS))
def test_decode_step_compiles_without_graph_breaks(name):
    mixer = make(name)
    x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(1))
    _, state = mixer(x[:, :10], use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(mixer, fullgraph=True, backend="eager")
    y, _ = compiled(x[:, 10:], state, use_cache=True)
    assert torch.equal(y, mixer(x[:, 10:], state, use_cache=True)[0])


POSITIONAL = ("loglinear-mamba2", "loglinear-gdn")  # packed documents run one by one, from host offsets


@pytest.mark.parametrize("name", [n for n in MIXERS if n not in POSITIONAL])
def test_packed_forward_compiles_without_graph_breaks(name):
    """Packed documents without a state (training): the offsets stay on the device, one graph."""
    mixer = make(name)
    x = torch.randn(1, 19, 16, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 5, 12, 19])
    torch._dynamo.reset()
    y, _ = torch.compile(mixer, fullgraph=True, backend="eager")(x, cu_seqlens=cu)
    assert torch.equal(y, mixer(x, cu_seqlens=cu)[0])
