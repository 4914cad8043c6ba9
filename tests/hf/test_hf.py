"""`polyattn.hf`: Auto registration, training, save/load, and `generate()` (greedy, sampling, beam search,
EOS and stopping criteria, left-padded prompts) against polyattn's own cached and uncached decoding."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

import polyattn.hf
from polyattn.hf import PolyattnCache, PolyattnConfig, PolyattnForCausalLM
from polyattn.layers import MIXERS
from polyattn.models import CausalLM, LMConfig
from polyattn.testing import assert_close_rel

VOCAB, PROMPT, NEW = 37, 7, 6
HYBRID = ["softmax", "loglinear-mamba2", "deltakata-m1"]


def config(mixer, **overrides):
    # init_std 0.5: peaked next-token distributions, so greedy and beam choices are far from ties
    options = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=len(mixer) if isinstance(mixer, list) else 2,
                   mixer=mixer, mixer_config={"num_heads": 2}, mlp_ratio=2.0, init_std=0.5, pad_token_id=0)
    return AutoConfig.for_model("polyattn", **{**options, **overrides})


def model_for(mixer, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config(mixer, **overrides)).double().eval()


def prompts(B=2, T=PROMPT, seed=1):
    return torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def test_registered_with_auto_classes():
    cfg = AutoConfig.for_model("polyattn", mixer="gdn")
    assert isinstance(cfg, PolyattnConfig) and cfg.model_type == "polyattn"
    assert type(AutoModelForCausalLM.from_config(cfg)) is PolyattnForCausalLM
    assert polyattn.hf.PolyattnForCausalLM is PolyattnForCausalLM


@pytest.mark.parametrize("mixer", [*MIXERS, HYBRID], ids=lambda m: "hybrid" if isinstance(m, list) else m)
def test_trains_and_round_trips_through_save_pretrained(tmp_path, mixer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(mixer, init_std=0.02))
    ids = prompts(4, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for _ in range(3):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(model(ids, labels=ids).loss.item())
    assert losses[-1] < losses[0], losses
    model.eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is PolyattnForCausalLM and loaded.config.mixer == mixer
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("mixer", [*MIXERS, HYBRID], ids=lambda m: "hybrid" if isinstance(m, list) else m)
def test_greedy_generate_equals_own_decoding_and_full_forwards(mixer):
    model = model_for(mixer)
    ids = prompts()
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert out.shape == (2, PROMPT + NEW)
    assert torch.equal(out, model.model.generate(ids, NEW, use_cache=True))
    assert torch.equal(out, model.generate(ids, max_new_tokens=NEW, do_sample=False, use_cache=False))
    tokens = ids
    with torch.no_grad():
        for _ in range(NEW):  # argmax of full forwards, no cache
            tokens = torch.cat([tokens, model(tokens, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, tokens)


@pytest.mark.parametrize("mixer", [*MIXERS, HYBRID], ids=lambda m: "hybrid" if isinstance(m, list) else m)
def test_beam_search_with_cache_equals_without(mixer):
    model = model_for(mixer)
    ids = prompts()
    options = dict(max_new_tokens=NEW, num_beams=4, num_return_sequences=3, do_sample=False,
                   return_dict_in_generate=True, output_scores=True)
    cached = model.generate(ids, **options)
    uncached = model.generate(ids, **options, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert_close_rel(cached.sequences_scores, uncached.sequences_scores, 1e-9, mixer)


@pytest.mark.parametrize("mixer", ["softmax", "mamba2", "loglinear-gdn", "kata-s2"])
def test_sampling_is_reproducible_and_cache_independent(mixer):
    model = model_for(mixer)
    ids = prompts()
    options = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=12, top_p=0.9)
    runs = []
    for use_cache in (True, True, False):
        torch.manual_seed(7)
        runs.append(model.generate(ids, **options, use_cache=use_cache))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    torch.manual_seed(8)
    assert not torch.equal(runs[0], model.generate(ids, **options)), "a different seed should sample differently"


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_left_padded_prompts_generate_as_alone(mixer):
    """Rows of different lengths, left-padded with garbage tokens: each row continues as it does alone,
    greedy (with and without the cache) and beam search."""
    model = model_for(mixer)
    lengths = (PROMPT, 2, 4)
    ids = prompts(len(lengths), PROMPT, seed=2)  # garbage everywhere the mask is 0
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, PROMPT - n :] = 1
    for options in (dict(do_sample=False), dict(do_sample=False, use_cache=False), dict(num_beams=3, do_sample=False)):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **options)
        for i, n in enumerate(lengths):
            alone = model.generate(ids[i : i + 1, PROMPT - n :], max_new_tokens=NEW, **options)
            assert torch.equal(out[i, PROMPT:], alone[0, n:]), (mixer, options, i)


def test_eos_and_stopping_criteria_end_generation():
    model = model_for("gdn")
    ids = prompts(1)
    free = model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, PROMPT:]
    eos = int(free[2])
    first = int((free == eos).nonzero()[0])
    stopped = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    assert torch.equal(stopped[0, PROMPT:], free[: first + 1])

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= PROMPT + 2, dtype=torch.bool)

    short = model.generate(ids, max_new_tokens=NEW, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAfter()]))
    assert torch.equal(short[0, PROMPT:], free[:2])


def test_cache_holds_every_layer_state_and_reorders_rows():
    model = model_for(HYBRID)
    ids = prompts(3)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.cache
        assert isinstance(cache, PolyattnCache) and len(cache) == len(HYBRID)
        assert cache.get_seq_length() == PROMPT
        order = torch.tensor([2, 0, 0])
        cache.reorder_cache(order)
        nxt = prompts(3, 1, seed=9)
        stepped = model(nxt, cache=cache).logits
        reference = model(torch.cat([ids[order], nxt], dim=1)).logits[:, -1:]
    assert_close_rel(stepped, reference, 1e-9, "reordered cache")
    assert cache.get_seq_length() == PROMPT + 1


def test_packed_documents_and_loss():
    """cu_seqlens through the HF forward: logits per document as alone; the loss skips boundaries."""
    model = model_for(HYBRID)
    docs = [prompts(1, n, seed=n)[0] for n in (5, 1, 8)]
    cu_seqlens = torch.tensor([0, 5, 6, 14])
    packed = torch.cat(docs)[None]
    with torch.no_grad():
        out = model(packed, labels=packed, cu_seqlens=cu_seqlens, use_cache=False)
        for doc, piece in zip(docs, out.logits[0].split([5, 1, 8])):
            assert_close_rel(piece, model(doc[None]).logits[0], 1e-9, "packed document")
        alone = [model(d[None], labels=d[None]).loss * (len(d) - 1) for d in docs if len(d) > 1]
    assert_close_rel(out.loss, sum(alone) / (14 - 3), 1e-9, "packed loss")


def test_a_polyattn_checkpoint_converts_with_identical_logits(tmp_path):
    torch.manual_seed(0)
    lm = CausalLM(LMConfig(vocab_size=VOCAB, d_model=16, n_layers=3, mixer="gdn", mixer_config={"num_heads": 2},
                           layer_mixers=["gdn", {"name": "kata-m2", "num_heads": 4}, "softmax"])).double()
    model = PolyattnForCausalLM.from_causal_lm(lm, eos_token_id=3)
    assert [b.mixer.heads for b in model.model.blocks] == [2, 4, 2]  # softmax: the default, as in the LM
    ids = prompts()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, lm(ids)[0])
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert loaded.config.eos_token_id == 3
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    with torch.no_grad():  # bitwise-equal weights; loaded ones sit at other memory alignments (BLAS rounding)
        assert_close_rel(loaded(ids).logits, lm(ids)[0], 1e-12, "reloaded")


def test_bad_input_raises():
    with pytest.raises(ValueError, match="unknown mixer 'nope'"):
        PolyattnConfig(mixer="nope")
    with pytest.raises(ValueError, match="one entry per layer"):
        PolyattnConfig(mixer=["softmax"], num_hidden_layers=2)
    model = model_for("linear")
    ids = prompts()
    with pytest.raises(ValueError, match="expected input_ids"):
        model(inputs_embeds=torch.zeros(2, 3, 16))
    with pytest.raises(ValueError, match="labels: expected shape"):
        model(ids, labels=ids[:, :3])
    with pytest.raises(ValueError, match="unsupported arguments"):
        model(ids, output_attentions=True)
