"""The causal LM: cached generation == recomputation, save/load round trip, hybrids, config errors."""

import pytest
import torch

from polyattn.layers import MIXERS
from polyattn.models import CausalLM, LMConfig
from polyattn.testing import assert_close_rel

VOCAB = 37


def tiny(mixer="softmax", **overrides):
    torch.manual_seed(0)
    config = LMConfig(vocab_size=VOCAB, d_model=16, n_layers=2, mixer=mixer, mixer_config={"num_heads": 2}, mlp_ratio=2.0)
    for key, value in overrides.items():
        setattr(config, key, value)
    return CausalLM(config).double()


@pytest.mark.parametrize("name", list(MIXERS))
def test_generate_with_cache_equals_recomputation(name):
    model = tiny(name)
    prompt = torch.randint(VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    cached = model.generate(prompt, 5, use_cache=True)
    assert cached.shape == (2, 14)
    assert torch.equal(cached, model.generate(prompt, 5, use_cache=False))
    # the logits along the way agree too, not just the argmax
    logits, state = model(cached[:, :9], use_cache=True)
    steps = [logits]
    for t in range(9, 14):
        logits, state = model(cached[:, t : t + 1], state, use_cache=True)
        steps.append(logits)
    assert_close_rel(torch.cat(steps, dim=1), model(cached)[0], 1e-9, name)


@pytest.mark.parametrize("name", ["softmax", "loglinear-gdn", "kata-m2"])
def test_save_load_gives_identical_logits(tmp_path, name):
    model = tiny(name).float()
    ids = torch.randint(VOCAB, (2, 13))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    loaded = CausalLM.from_pretrained(tmp_path)
    assert loaded.config == model.config
    assert torch.equal(loaded(ids)[0], model(ids)[0])


def test_hybrid_layers_and_state_size():
    model = tiny(layer_mixers=["softmax", {"name": "gdn", "num_heads": 4}])
    assert [b.mixer.name for b in model.blocks] == ["softmax", "gdn"]
    assert model.blocks[1].mixer.heads == 4
    assert model.state_size(100) == sum(b.mixer.state_size(100) for b in model.blocks)
    prompt = torch.randint(VOCAB, (1, 9))
    assert torch.equal(model.generate(prompt, 5), model.generate(prompt, 5, use_cache=False))


def test_no_mlp_and_tied_head():
    model = tiny(mlp_ratio=0.0)
    assert all(b.mlp is None for b in model.blocks)
    logits, _ = model(torch.randint(VOCAB, (1, 5)))
    assert logits.shape == (1, 5, VOCAB)
    assert not any("head" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"mixer": "nope"}, "unknown mixer"),
        ({"layer_mixers": ["softmax"]}, "expected 2 layer_mixers"),
        ({"mlp_ratio": -1.0}, "mlp_ratio >= 0"),
    ],
    ids=["unknown-mixer", "layer-count", "mlp-ratio"],
)
def test_invalid_configs_raise(overrides, match):
    config = LMConfig(vocab_size=VOCAB, **overrides)
    with pytest.raises(ValueError, match=match):
        CausalLM(config)


HYBRID = ["softmax", "mamba2", "loglinear-gdn", "kata-m2"]


def per_sequence(model, docs):
    """Logits of each token list alone and the parameter gradients of Σ_docs Σ w·logits."""
    model.zero_grad()
    outs = []
    for i, ids in enumerate(docs):
        logits, _ = model(ids[None])
        (logits * torch.randn(logits.shape, dtype=logits.dtype, generator=torch.Generator().manual_seed(i))).sum().backward()
        outs.append(logits.detach()[0])
    return outs, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("layout", ["left-padded", "packed"])
def test_padded_and_packed_batches_give_each_sequence_its_own_logits(layout):
    """Garbage tokens in the padding and other documents in the row change nothing, forward or backward."""
    model = tiny(n_layers=len(HYBRID), layer_mixers=HYBRID)
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(VOCAB, (n,), generator=gen) for n in (6, 1, 11, 3)]
    outs, grads = per_sequence(model, docs)
    model.zero_grad()
    if layout == "packed":
        cu_seqlens = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()])
        logits, _ = model(torch.cat(docs)[None], cu_seqlens=cu_seqlens)
        pieces = logits[0].split([len(d) for d in docs])
    else:
        T = max(len(d) for d in docs)
        ids = torch.randint(VOCAB, (len(docs), T), generator=gen)  # garbage where the mask is 0
        mask = torch.zeros(len(docs), T, dtype=torch.long)
        for i, d in enumerate(docs):
            ids[i, T - len(d) :], mask[i, T - len(d) :] = d, 1
        logits, _ = model(ids, attention_mask=mask)
        pieces = [logits[i, T - len(d) :] for i, d in enumerate(docs)]
    loss = sum((p * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(i))).sum() for i, p in enumerate(pieces))
    loss.backward()
    for i, (piece, out) in enumerate(zip(pieces, outs)):
        assert_close_rel(piece, out, 1e-9, f"{layout} sequence {i}")
    for p, g in zip(model.parameters(), grads):
        assert_close_rel(p.grad, g, 1e-9, f"{layout} parameter gradient")


@pytest.mark.parametrize(
    "ids, message",
    [
        (torch.tensor([[1, 2, 64]]), r"input_ids: expected token ids in \[0, 64\)"),
        (torch.tensor([[1, -1]]), r"input_ids: expected token ids in \[0, 64\)"),
        (torch.tensor([[1.0, 2.0]]), r"input_ids: expected an int64 tensor \[B, T\], got dtype torch.float32"),
        (torch.tensor([1, 2]), r"input_ids: expected an int64 tensor \[B, T\], got dtype torch.int64, shape \(2,\)"),
    ],
    ids=["too-large", "negative", "float", "1-D"],
)
def test_bad_token_ids(ids, message):
    model = CausalLM(LMConfig(vocab_size=64, d_model=16, n_layers=1, mixer="linear"))
    with pytest.raises(ValueError, match=message):
        model(ids)


def test_from_pretrained_missing_or_corrupt(tmp_path):
    with pytest.raises(ValueError, match=r"from_pretrained: expected config.json in .* found none"):
        CausalLM.from_pretrained(tmp_path / "absent")
    with pytest.raises(ValueError, match=r"from_pretrained: expected config.json"):
        CausalLM.from_pretrained(tmp_path)  # an empty folder
    model = CausalLM(LMConfig(vocab_size=64, d_model=16, n_layers=1, mixer="linear"))
    model.save_pretrained(tmp_path / "ok")
    (tmp_path / "ok" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"from_pretrained: model.safetensors in .* does not hold this model's weights"):
        CausalLM.from_pretrained(tmp_path / "ok")
    (tmp_path / "ok" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"from_pretrained: config.json in .* is not a valid LMConfig"):
        CausalLM.from_pretrained(tmp_path / "ok")
    (tmp_path / "ok" / "config.json").write_text('{"vocab_size": 64, "bogus": 1}')
    with pytest.raises(ValueError, match=r"is not a valid LMConfig"):
        CausalLM.from_pretrained(tmp_path / "ok")
