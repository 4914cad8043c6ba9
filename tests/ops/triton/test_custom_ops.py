"""The Triton forms as `torch.library` custom ops: `torch.compile(fullgraph=True)` traces them as opaque
calls (no graph break), forward and backward equal eager, and `torch.library.opcheck` accepts the ops'
schemas, fake functions and autograd registrations. On CPU the kernels run under the interpreter."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from polyattn import ops
from polyattn.layers import build_mixer
from polyattn.ops.common import num_levels
from polyattn.ops.kata.feature_maps import make_feature_map
from polyattn.ops.kata.state import KataState
from polyattn.ops.loglinear import LogLinearState
from polyattn.testing import assert_close_rel, seeded_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(op):
    x = seeded_inputs(1, 70, 2, 8, 12, decay=True, beta=True, seed=0, device=DEVICE, dtype=torch.float32)
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    x["lam"] = torch.rand(1, 70, 2, 8, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    names = {"delta_rule": ("q", "k", "v", "beta", "g"), "loglinear_attn": ("q", "k", "v", "g", "lam")}.get(op, ("q", "k", "v", "g"))
    return [x[n].clone().requires_grad_() for n in names]


def _loglinear_state():
    """A log-linear state at position 21 (off the chunk grid) with every level filled."""
    levels = torch.randn(1, 2, 8, 8, 12, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    return LogLinearState(levels, torch.tensor([21], device=DEVICE))


@pytest.mark.parametrize("op", ["linear_attn", "delta_rule", "hla", "loglinear_attn", "kata_chunk"])
def test_triton_forms_compile_as_one_graph(op):
    h0 = torch.randn(1, 2, 8, 12, device=DEVICE)
    state = _loglinear_state()

    def loss(*tensors):
        if op == "kata_chunk":
            o, s = ops.kata(*tensors, impl="triton_chunk", initial_state=KataState(h0.new_ones(1, 2, 64, 12), h0.new_ones(1, 2, 64)),
                            output_final_state=True)
            return o.square().sum() + s.S.sum()
        if op == "hla":
            o, _ = ops.hla(*tensors, impl="triton")
            return o.square().sum()
        if op == "loglinear_attn":
            q, k, v, g, lam = tensors
            o, s = ops.loglinear_attn(q, k, v, lam, g, impl="triton", initial_state=state, output_final_state=True)
            return o.square().sum() + s.levels.sum()
        o, ht = getattr(ops, op)(*tensors, impl="triton", initial_state=h0, output_final_state=True)
        return o.square().sum() + ht.sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    leaves = _inputs(op)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    want = torch.autograd.grad(loss(*leaves), leaves)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close_rel(a, b, 1e-6, f"{op} gradient {i}")


@pytest.mark.parametrize("op", ["delta_rule", "kata", "deltakata", "loglinear_mamba2", "loglinear_gdn"])
def test_gradient_through_the_final_state_alone(op):
    """A loss of the final state alone, o unused: autograd hands the custom op no output cotangent (the ops
    turn off materialized zeros, so their saved intermediates cost no zero fill) and every gradient equals
    the PyTorch chunk form's."""
    K = 16 if op == "deltakata" else 8  # DeltaKATA's chunked kernels take key groups of 16 or more
    x = seeded_inputs(1, 70, 2, K, 12, decay=True, beta=True, seed=5, device=DEVICE, dtype=torch.float32)
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    loglinear = op.startswith("loglinear")
    names = ("q", "k", "v", "g") + (("beta",) if op not in ("kata", "loglinear_mamba2") else ())
    P = make_feature_map("psd", K, 1, "concat").dim() if op in ("kata", "deltakata") else K  # the state's rows
    L = num_levels(70)  # the log-linear states' levels
    levels = (L,) if loglinear else ()
    weight = torch.randn(1, 2, *levels, P, 12, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    lam = torch.rand(1, 70, 2, L, generator=torch.Generator().manual_seed(7)).to(DEVICE)

    def loss(impl, *tensors):
        if loglinear:
            q, k, v, g, *beta = tensors
            _, s = ops.loglinear_attn(q, k, v, lam, g, beta=beta[0] if beta else None, impl=impl, output_final_state=True)
            return (s.levels * weight).sum()
        if op == "kata":
            _, s = ops.kata(*tensors, impl=impl, output_final_state=True)
            return (s.S * weight).sum() + s.z.square().sum()
        q, k, v, g, beta = tensors
        if op == "delta_rule":
            _, state = ops.delta_rule(q, k, v, beta, g, impl=impl, output_final_state=True)
        else:
            _, state = ops.kata(q, k, v, g, beta=beta, normalize=False, impl=impl, output_final_state=True)
        return (state * weight).sum()

    leaves = [x[n].clone().requires_grad_() for n in names]
    fast = "triton" if op == "delta_rule" or loglinear else "triton_chunk"
    got = torch.autograd.grad(loss(fast, *leaves), leaves, allow_unused=True, materialize_grads=True)
    want = torch.autograd.grad(loss("chunk", *leaves), leaves, allow_unused=True, materialize_grads=True)
    for name, a, b in zip(names, got, want):
        assert_close_rel(a, b, 1e-4, f"{op} d{name}")


def test_loglinear_gdn_compiles_as_one_graph():
    """The Gated DeltaNet base (its forward and backward ops) traces as opaque calls from a state off
    the chunk grid, forward and gradients (the state's too) equal to eager, and opcheck accepts both
    ops' schemas and fakes."""
    from polyattn.ops.loglinear.triton.function import loglinear_gdn_backward, loglinear_gdn_forward

    x = seeded_inputs(1, 70, 2, 8, 12, decay=True, beta=True, seed=0, device=DEVICE, dtype=torch.float32)
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    lam = torch.rand(1, 70, 2, 8, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def loss(q, k, v, lam, g, beta, levels):
        state = LogLinearState(levels, torch.tensor([21], device=DEVICE))
        o, s = ops.loglinear_attn(q, k, v, lam, g, beta=beta, impl="triton", initial_state=state, output_final_state=True)
        return o.square().sum() + s.levels.sum()

    leaves = [t.clone().requires_grad_() for t in (x["q"], x["k"], x["v"], lam, x["g"], x["beta"], _loglinear_state().levels)]
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves), leaves)
    want = torch.autograd.grad(loss(*leaves), leaves)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close_rel(a, b, 1e-6, f"gradient {i}")
    q, k, v, lam, g, beta = (t.detach() for t in leaves[:6])
    position = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    r0 = torch.randn(1, 2, 1, 8, 12, device=DEVICE)
    q16, k16, v16, lam16, beta16 = (t.bfloat16().float() for t in (q, k, v, lam, beta))  # fp32 copies of bf16 values
    for args in [(q, k, v, lam, g, beta, r0, position + 21, 0.5, [70], True, True, torch.float32),
                 (q, k, v, lam, None, beta, None, position, 0.5, [70], False, False, torch.float32),
                 (q16, k16, v16, lam16, g, beta16, None, position, 0.5, [70], False, True, torch.bfloat16)]:
        torch.library.opcheck(loglinear_gdn_forward, args, test_utils=("test_schema", "test_faketensor"))
    rows = (torch.randn(1, 64, 2, 8, device=DEVICE), torch.randn(1, 64, 2, 64, device=DEVICE), torch.randn(1, 64, 2, 8, device=DEVICE))
    for args in [(torch.randn_like(v), torch.randn_like(r0), *rows, q, k, v, lam, g, beta, r0, position + 21, 0.5, [70], torch.float32),
                 (torch.randn_like(v), None, None, None, None, q, k, v, lam, None, beta, None, position, 0.5, [70], torch.float32),
                 (torch.randn_like(v).bfloat16(), None, None, None, None, q16, k16, v16, lam16, g, beta16, None, position, 0.5, [70],
                  torch.bfloat16)]:
        torch.library.opcheck(loglinear_gdn_backward, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("name", ["linear", "gdn", "loglinear-mamba2", "loglinear-gdn"])
def test_mixer_training_step_compiles_with_triton_forms(name):
    mixer = build_mixer(name, 16, num_heads=2, impl="triton").to(DEVICE)
    x = torch.randn(2, 19, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(mixer, fullgraph=True, backend="aot_eager")
    y, _ = compiled(x)
    grads = torch.autograd.grad(y.square().sum(), list(mixer.parameters()))
    y_eager, _ = mixer(x)
    grads_eager = torch.autograd.grad(y_eager.square().sum(), list(mixer.parameters()))
    assert_close_rel(y, y_eager, 1e-6, f"{name} output")
    for a, b in zip(grads, grads_eager):
        assert_close_rel(a, b, 1e-5, f"{name} parameter gradient")


def test_custom_ops_pass_opcheck():
    import polyattn.ops.delta.triton.function  # noqa: F401  (registers polyattn::delta_rule_*)
    import polyattn.ops.linear.triton.function  # noqa: F401  (registers polyattn::linear_attn_*)
    import polyattn.ops.loglinear.triton.function  # noqa: F401  (registers polyattn::loglinear_attn_*)

    q, k, v, beta, g = (t.detach() for t in _inputs("delta_rule"))
    h0 = torch.randn(1, 2, 8, 12, device=DEVICE)
    seq_lens = [70]
    for args in [(q, k, v, g, h0, 0.3, seq_lens, True), (q, k, v, None, None, 0.3, seq_lens, False)]:
        torch.library.opcheck(torch.ops.polyattn.linear_attn_forward.default, args,
                              test_utils=("test_schema", "test_faketensor"))
    for args in [(q, k, v, beta, g, h0, 0.3, seq_lens, True, True), (q, k, v, beta, None, None, 0.3, seq_lens, False, False)]:
        torch.library.opcheck(torch.ops.polyattn.delta_rule_forward.default, args,
                              test_utils=("test_schema", "test_faketensor"))
    lam = torch.rand(1, 70, 2, 8, device=DEVICE)
    r0, low = torch.randn(1, 2, 3, 8, 12, device=DEVICE), torch.randn(1, 2, 5, 8, 12, device=DEVICE)
    position = torch.tensor([21], device=DEVICE)
    for args in [(q, k, v, lam, g, r0, low, position, 0.3, seq_lens, 16, True),
                 (q, k, v, lam, None, None, None, torch.zeros_like(position), 0.3, seq_lens, 16, False)]:
        torch.library.opcheck(torch.ops.polyattn.loglinear_attn_forward.default, args,
                              test_utils=("test_schema", "test_faketensor"))


class _RecordCustomOps(TorchDispatchMode):
    """Records every `polyattn::` custom-op call that reaches the dispatcher (below autograd, so the
    backward ops too), with its tensors detached."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "polyattn":
            detach = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731
            self.calls.append((func, tree_map(detach, args), tree_map(detach, kwargs)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("op", ["linear_attn", "delta_rule", "hla", "loglinear_attn", "kata", "kata_chunk"])
def test_custom_ops_fake_outputs_match_real_strides(op):
    """Every forward and backward custom op of a gated call, at the arguments a real backward passes it:
    the fake function's outputs have the real outputs' sizes and strides (inductor asserts both on
    CUDA; the log-decay gradient once came back transposed)."""
    leaves = _inputs(op)
    with _RecordCustomOps() as record:
        if op == "hla":
            o, ht = ops.hla(*leaves, impl="triton")
        elif op == "kata":
            o, ht = ops.kata(*leaves, impl="triton_parallel")
        elif op == "kata_chunk":  # from a state, the final state used: every input of the backward op
            state = KataState(torch.randn(1, 2, 64, 12, device=DEVICE), torch.rand(1, 2, 64, device=DEVICE))
            o, final = ops.kata(*leaves, impl="triton_chunk", initial_state=state, output_final_state=True)
            ht = final.S
        elif op == "loglinear_attn":
            q, k, v, g, lam = leaves
            o, ht = ops.loglinear_attn(q, k, v, lam, g, impl="triton", initial_state=_loglinear_state(), output_final_state=True)
            ht = ht.levels
        else:
            o, ht = getattr(ops, op)(*leaves, impl="triton", initial_state=torch.randn(1, 2, 8, 12, device=DEVICE),
                                     output_final_state=True)
        loss = o.square().sum() + (ht.sum() if ht is not None else 0)
        torch.autograd.grad(loss, leaves)
    names = [func.name() for func, _, _ in record.calls]
    assert any(n.endswith("_forward") for n in names) and any(n.endswith("_backward") for n in names), names
    for func, args, kwargs in record.calls:
        torch.library.opcheck(func, args, kwargs, test_utils=("test_faketensor",))
