"""Every registered mixer: prefill + one-token steps == full forward in float64, state sizes, config errors."""

import pytest
import torch

from polyattn.layers import MIXERS, build_mixer, mixer_form
from polyattn.ops.common import num_levels
from polyattn.testing import assert_close_rel

D_MODEL, T = 16, 23


def make(name, **config):
    torch.manual_seed(0)
    return build_mixer(name, D_MODEL, num_heads=2, **config).double()


def float_numel(state):
    if isinstance(state, torch.Tensor):
        return state.numel() if state.is_floating_point() else 0
    return sum(float_numel(s) for s in state)


@pytest.mark.parametrize("name", list(MIXERS))
@pytest.mark.parametrize("prefix", [1, 9, 22], ids=lambda p: f"prefill{p}")
def test_prefill_then_steps_equals_full(name, prefix):
    mixer = make(name)
    x = torch.randn(2, T, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    full, none = mixer(x)
    assert none is None
    outs = []
    y, state = mixer(x[:, :prefix], use_cache=True)
    outs.append(y)
    for t in range(prefix, T):
        y, state = mixer(x[:, t : t + 1], state, use_cache=True)
        outs.append(y)
    assert state.position == T
    assert_close_rel(torch.cat(outs, dim=1), full, 1e-9, name)


@pytest.mark.parametrize("name", list(MIXERS))
def test_chunked_continuation_equals_full(name):
    mixer = make(name)
    x = torch.randn(1, T, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    full, _ = mixer(x)
    y1, state = mixer(x[:, :8], use_cache=True)
    y2, state = mixer(x[:, 8:], state, use_cache=True)
    assert_close_rel(torch.cat([y1, y2], dim=1), full, 1e-9, name)


@pytest.mark.parametrize("name", list(MIXERS))
def test_state_size_counts_the_state(name):
    """`state_size(T)` == floats in the returned state per sequence (log-linear: the levels in use)."""
    mixer = make(name)
    x = torch.randn(2, T, D_MODEL, dtype=torch.float64)
    _, state = mixer(x, use_cache=True)
    held = (float_numel(state.core) + float_numel(state.conv)) // 2
    if name.startswith("loglinear"):
        per_level = mixer.core_state_size(1)
        assert mixer.core_state_size(T) == num_levels(T) * per_level
        assert held == mixer.config.max_levels * per_level + mixer.conv_state_size()
    else:
        assert mixer.state_size(T) == held


def test_softmax_state_grows_recurrent_states_do_not():
    assert make("softmax").state_size(200) > make("softmax").state_size(100)
    for name in ("linear", "mamba2", "gdn", "hla2", "kata-m2", "deltakata-m1"):
        assert make(name).state_size(200) == make(name).state_size(100), name


def test_kata_state_sizes_follow_the_feature_dimension():
    dk = D_MODEL // 2
    assert make("kata-m1").core_state_size(1) == 2 * dk * dk * (dk + 1)
    assert make("kata-m2").core_state_size(1) == 2 * 2 * (dk // 2) ** 2 * (dk + 1)
    assert make("kata-s2").core_state_size(1) == 2 * (dk // 2) ** 2 * (dk + 1)
    assert make("deltakata-m1").core_state_size(1) == 2 * dk * dk * dk


def test_bad_configs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown mixer 'nope'"):
        build_mixer("nope", D_MODEL)
    with pytest.raises(ValueError, match=r"unknown options \['bogus'\]"):
        build_mixer("gdn", D_MODEL, bogus=1)
    with pytest.raises(ValueError, match="positive feature map"):
        build_mixer("hla2", D_MODEL, normalize=True)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        build_mixer("softmax", D_MODEL, num_heads=3)
    with pytest.raises(ValueError, match="groups"):
        build_mixer("kata-m2", D_MODEL, num_heads=2, groups=3)
    with pytest.raises(ValueError, match="qk_norm must be one of"):
        build_mixer("kata-m1", D_MODEL, qk_norm="layer")


def test_normalized_hla_with_positive_features_is_exact_when_streamed():
    mixer = make("hla2", normalize=True, feature_map="elu1")
    x = torch.randn(1, 12, D_MODEL, dtype=torch.float64)
    full, _ = mixer(x)
    y1, state = mixer(x[:, :5], use_cache=True)
    y2, _ = mixer(x[:, 5:], state, use_cache=True)
    assert_close_rel(torch.cat([y1, y2], dim=1), full, 1e-9)


@pytest.mark.parametrize("name", ["mamba2", "loglinear-mamba2"])
def test_mamba2_without_skip_and_gate_is_exact_when_streamed(name):
    mixer = make(name, d_skip=False, output_gate=False)
    assert mixer.D is None and not any(n == "D" for n, _ in mixer.named_parameters())
    x = torch.randn(1, 12, D_MODEL, dtype=torch.float64)
    full, _ = mixer(x)
    y1, state = mixer(x[:, :5], use_cache=True)
    y2, _ = mixer(x[:, 5:], state, use_cache=True)
    assert_close_rel(torch.cat([y1, y2], dim=1), full, 1e-9)
    with_skip = make(name, output_gate=False)
    with torch.no_grad():
        with_skip.D.zero_()
    assert_close_rel(with_skip(x)[0], full, 1e-12)


@pytest.mark.parametrize("name", ["hla2", "ahla", "hla3"])
@pytest.mark.parametrize("outer_decay", [False, True], ids=["inner-decay", "outer-decay"])
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_hla_decay_placements_are_exact_when_streamed(name, outer_decay, normalize):
    features = {"normalize": True, "feature_map": "relu"} if normalize else {}
    mixer = make(name, outer_decay=outer_decay, **features)
    x = torch.randn(1, 12, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    full, _ = mixer(x)
    y1, state = mixer(x[:, :5], use_cache=True)
    outs = [y1]
    for t in range(5, 12):
        y, state = mixer(x[:, t : t + 1], state, use_cache=True)
        outs.append(y)
    assert_close_rel(torch.cat(outs, dim=1), full, 1e-9)


def test_hla2_inner_decay_matches_its_index_form():
    """``o_t = s² Σ_{j≤t} Σ_{i≤j} exp(g_{i+1}+…+g_j) (q_t·k_i)(q_j·k_i) v_j``: the key moment decays, the
    outer sum over j does not."""
    gen = torch.Generator().manual_seed(4)
    B, T, H, K, V = 1, 7, 2, 3, 4
    q, k = (torch.randn(B, T, H, K, dtype=torch.float64, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, dtype=torch.float64, generator=gen)
    g = -torch.rand(B, T, H, dtype=torch.float64, generator=gen)
    mixer = make("hla2")
    o, _ = mixer.inner_decay_hla(q, k, v, g, None, False, order=2, asymmetric=False, normalize=False)
    s = K**-0.5
    expected = torch.zeros_like(o)
    for t in range(T):
        for j in range(t + 1):
            for i in range(j + 1):
                w = torch.exp(g[:, i + 1 : j + 1].sum(1)) * (q[:, t] * k[:, i]).sum(-1) * (q[:, j] * k[:, i]).sum(-1)
                expected[:, t] += s * s * w[..., None] * v[:, j]
    assert_close_rel(o, expected, 1e-12)


@pytest.mark.parametrize("name", ["loglinear-mamba2", "loglinear-gdn"])
def test_loglinear_levels_grow_past_max_levels(name):
    """max_levels = 3 covers 4 tokens; prefill + steps to 23 tokens still equals one forward, levels growing."""
    mixer = make(name, max_levels=3)
    x = torch.randn(2, T, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    full, _ = mixer(x)
    y, state = mixer(x[:, :3], use_cache=True)
    outs = [y]
    for t in range(3, T):
        y, state = mixer(x[:, t : t + 1], state, use_cache=True)
        outs.append(y)
    assert state.core.levels.shape[2] == num_levels(T) > 3
    assert_close_rel(torch.cat(outs, dim=1), full, 1e-9, name)


def test_loglinear_mixer_decodes_past_16384_tokens():
    """The default (15 levels, 2**14 tokens) keeps decoding: tokens 16,384 and 16,385 need a 16th level."""
    torch.manual_seed(0)
    mixer = build_mixer("loglinear-mamba2", 8, num_heads=1, d_state=4, expand=1).double()
    x = torch.randn(1, 2**14 + 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    full, _ = mixer(x)
    y, state = mixer(x[:, : 2**14], use_cache=True)
    assert state.core.levels.shape[2] == 15
    steps = []
    for t in (2**14, 2**14 + 1):
        y_t, state = mixer(x[:, t : t + 1], state, use_cache=True)
        steps.append(y_t)
    assert state.core.levels.shape[2] == 16 and state.position == 2**14 + 2
    assert_close_rel(torch.cat([y] + steps, dim=1), full, 1e-9)


def _bad_values(field):
    """Values of the wrong type or range for a config option, by its declared type."""
    if field.type is bool:
        return [1, "no", None]
    if field.type in (int, int | None):
        return [0, -1, "4", 1.5, True]
    if field.type is float:
        return [0.0, -1.0, float("nan"), "x"]
    if field.name in ("impl", "decode_impl"):
        return ["bogus", 3]
    return [3]


@pytest.mark.parametrize("name", list(MIXERS))
def test_every_bad_option_raises_value_error(name):
    from dataclasses import fields

    for field in fields(MIXERS[name].config_class):
        for bad in _bad_values(field):
            with pytest.raises(ValueError, match=field.name):
                build_mixer(name, D_MODEL, **{"num_heads": 2, field.name: bad})
    with pytest.raises(ValueError, match="d_model: expected a positive integer"):
        build_mixer(name, 0)


@pytest.mark.parametrize("name", list(MIXERS))
def test_mixers_run_under_bf16_autocast(name):
    """Training and decoding under autocast (the GPU recipe): prefill and a one-token step give bf16 outputs
    (q, k and v reach the op in one dtype whatever the mixer normalises in fp32)."""
    mixer = build_mixer(name, 32, num_heads=2)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, state = mixer(x[:, :8], use_cache=True)
        y_step, _ = mixer(x[:, 8:], state, use_cache=True)
    assert y.dtype == y_step.dtype == torch.bfloat16
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(y_step).all())


def test_mixer_form_names_the_form_a_call_runs():
    assert mixer_form("softmax", "auto") == "sdpa"
    assert [mixer_form("gdn", "auto", T) for T in (1, 64)] == ["recurrent", "chunk"]
    assert mixer_form("hla2", "triton", 1) == "triton"
    assert mixer_form("kata-m1", "scan") == "scan"
    with pytest.raises(NotImplementedError, match="DeltaKATA has no impl='scan'"):
        mixer_form("deltakata-m1", "scan")
    assert mixer_form("kata-m2", "triton", 64) == "triton"
    assert mixer_form("deltakata-m1", "triton", 1) == "triton"
    with pytest.raises(ValueError, match="unknown mixer"):
        mixer_form("nope", "auto")


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("name", ["kata-m2", "deltakata-m1", "loglinear-gdn", "loglinear-mamba2"])
def test_mixer_form_auto_offers_what_the_op_offers(name, T, monkeypatch):
    """With "auto", mixer_form resolves among exactly the forms that the op's own "auto" offers on the
    mixer's real call (recorded from a training forward, with gradients, for more than one token; one
    token is a decoding call, without): the Triton forms always for decoding (the fused steps), for
    training calls for KATA (the quadratic kernel) and both log-linear bases, for DeltaKATA only at a group
    width its chunked kernels take (16 here: the mixer of width 32, two heads; width 16 gives 8, not taken)."""
    import importlib

    import polyattn.layers as layers

    offered = {}

    def recording(module, who):
        real = module.resolve_impl
        return lambda op, impl, forms, q: offered.setdefault(who, set(forms)) and real(op, impl, forms, q)

    monkeypatch.setattr(layers, "resolve_impl", recording(layers, "mixer_form"))
    for module in map(importlib.import_module, ("polyattn.ops.kata", "polyattn.ops.loglinear")):  # the modules, not the ops
        monkeypatch.setattr(module, "resolve_impl", recording(module, "op"))
    for width in (16, 32):
        offered.clear()
        mixer = build_mixer(name, width, num_heads=2)
        with torch.set_grad_enabled(T != 1):
            mixer(torch.randn(1, T, width))
        mixer_form(name, "auto", T, group_width=getattr(mixer, "group_width", 16))
        assert offered["mixer_form"] == offered["op"], (name, width)
        fits = getattr(mixer, "group_width", 16) >= 16
        assert ("triton" in offered["op"]) == (T == 1 or name != "deltakata-m1" or fits), (name, T, width)
    offered.clear()
    mixer_form("kata-m2", "triton", T)
    assert "triton" in offered["mixer_form"]  # by name: every form


FORWARD_ERRORS = {
    "x-2d": (lambda m, x: m(x[0]), r"x: expected a floating tensor \[B, T, d_model\] with d_model = 16"),
    "x-width": (lambda m, x: m(x[..., :15]), r"x: expected .* d_model = 16, got shape \(2, 9, 15\)"),
    "x-int": (lambda m, x: m(x.long()), r"x: expected a floating tensor"),
    "x-list": (lambda m, x: m(x.tolist()), r"x: expected .* got list"),
    "use_cache-int": (lambda m, x: m(x, use_cache=1), r"use_cache: expected a bool"),
    "state-str": (lambda m, x: m(x, "s"), r"state: expected the MixerState"),
    "state-tensor": (lambda m, x: m(x, torch.zeros(3)), r"state: expected the MixerState"),
    "state-batch": (lambda m, x: m(x[:1], m(x, use_cache=True)[1]), r"state: expected every tensor to lead with the batch size B = 1"),
    "mask-shape": (lambda m, x: m(x, attention_mask=torch.ones(2, 5)), r"attention_mask: expected shape \(2, 9\)"),
    "mask-empty-row": (lambda m, x: m(x, attention_mask=torch.ones(2, 9).index_fill(0, torch.tensor([1]), 0)), r"at least one token"),
    "mask-and-cu": (lambda m, x: m(x[:1], attention_mask=torch.ones(1, 9), cu_seqlens=torch.tensor([0, 9])), r"got both"),
    "cu-B2": (lambda m, x: m(x, cu_seqlens=torch.tensor([0, 9])), r"cu_seqlens: expected batch size B = 1"),
    "cu-order": (lambda m, x: m(x[:1], cu_seqlens=torch.tensor([0, 5, 3, 9])), r"strictly increasing"),
}


@pytest.mark.parametrize("name", list(MIXERS))
def test_bad_forward_input_raises_value_error(name):
    mixer = build_mixer(name, D_MODEL, num_heads=2)
    x = torch.randn(2, 9, D_MODEL, generator=torch.Generator().manual_seed(0))
    for call, message in FORWARD_ERRORS.values():
        with pytest.raises(ValueError, match=message):
            call(mixer, x)
