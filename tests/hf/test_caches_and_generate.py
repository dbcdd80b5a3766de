"""The transformers front end at dcp_size 1, in one process: caches of one model hold disjoint KV
locations (two live conversations, a generate() among them, released and dropped caches), what
generate() serves (classifier-free guidance, num_return_sequences) against the untouched model,
and what it refuses by name. One model serves every test, so its graphs compile once (batch 1
or 2 over caches of WIDTH positions); the multi-rank runs are in test_transformers_distributed.py."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

pytest.importorskip("transformers")

import dcp_compile  # noqa: E402
from tests.hf.models import prompt, tiny_model  # noqa: E402

WIDTH = 16
NEW_TOKENS = WIDTH - 5
POOL_LOCATIONS = 64
"""apply's default pool: 1 + max_position_embeddings locations, less location 0."""


@pytest.fixture(scope="module")
def models():
    """(the untouched model, the same weights through dcp_compile.apply at dcp_size 1)."""
    reference = tiny_model()
    return reference, dcp_compile.apply(copy.deepcopy(reference), dcp_size=1)


def _last_logits(model, input_ids, **kwargs):
    with torch.no_grad():
        return model(input_ids, **kwargs).logits[:, -1]


def _generate(model, input_ids, **kwargs):
    with torch.no_grad():
        out = model.generate(*(() if input_ids is None else (input_ids,)), max_new_tokens=NEW_TOKENS, output_logits=True, output_scores=True,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits), torch.stack(out.scores)


def _assert_matches(got, want):
    assert torch.equal(got[0], want[0])
    assert float((got[1] - want[1]).abs().max()) < 1e-5
    # -inf where a processor masked a token in both: inf - inf is nan, taken as equal
    assert float((got[2] - want[2]).nan_to_num(nan=0.0).abs().max()) < 1e-5


def test_two_live_caches_and_a_generate_keep_their_own_kv(models):
    """Prefill A in one cache and B in another, then decode A and B, and generate() with both live,
    twice: every logit is transformers' (before, the caches shared locations and A's logits were
    off by 3.35)."""
    reference, model = models
    histories = [prompt(1)[:1], prompt(2)[:1]]
    caches = [model.new_cache(1, WIDTH), model.new_cache(1, WIDTH)]

    def step(cache, input_ids, history):
        got = _last_logits(model, input_ids, **{model.cache_kwarg: cache})
        assert float((got - _last_logits(reference, history)).abs().max()) < 1e-5

    for cache, history in zip(caches, histories):
        step(cache, history, history)
    token = torch.tensor([[3]])
    for _ in range(2):
        for i, cache in enumerate(caches):
            histories[i] = torch.cat([histories[i], token], 1)
            step(cache, token, histories[i])
        third = prompt(3)[:1]
        _assert_matches(_generate(model, third, do_sample=False), _generate(reference, third, do_sample=False))
    locations = [set(cache.layers[0].req_to_token.flatten().tolist()) for cache in caches]
    assert not locations[0] & locations[1] and 0 not in locations[0] | locations[1]


def _free_locations(model) -> int:
    """The pool's free locations: what a cache of one row takes by default."""
    cache = model.new_cache(1)
    cache.release()
    return cache.max_length


def test_a_cache_gives_its_locations_back(models):
    _, model = models
    gc.collect()
    assert _free_locations(model) == POOL_LOCATIONS  # every earlier cache was given back
    kept = model.new_cache(2, WIDTH)
    with pytest.raises(MemoryError, match=rf"a cache of 1 row\(s\) of {POOL_LOCATIONS} positions needs {POOL_LOCATIONS} KV "
                                          rf"locations; the pool has {POOL_LOCATIONS} \(location 0 is reserved\), "
                                          rf"{POOL_LOCATIONS - 2 * WIDTH} of them free: 1 live cache\(s\) hold the rest"):
        model.new_cache(1, POOL_LOCATIONS)
    assert _free_locations(model) == POOL_LOCATIONS - 2 * WIDTH
    with pytest.raises(ValueError, match=r"need 66 KV locations \(location 0 is reserved\); the pool holds 65"):
        model.new_cache(1, POOL_LOCATIONS + 1)  # more than the pool holds: never fits
    kept.release()
    with pytest.raises(ValueError, match="this cache was released"):
        _last_logits(model, prompt()[:, :1], **{model.cache_kwarg: kept})
    dropped = model.new_cache(1, POOL_LOCATIONS)  # fits once `kept` is released
    del dropped
    model.new_cache(1, POOL_LOCATIONS).release()  # and again, once `dropped` is garbage collected
    assert _free_locations(model) == POOL_LOCATIONS


def test_guidance_matches_transformers(models):
    """Classifier-free guidance: transformers' processor calls the model from inside generate()
    for its unconditional pass, first without a cache, then with the one that call returned;
    that call gets a cache of the generation's width from the pool."""
    reference, model = models
    for negative in (None, prompt(4)[:1, :3]):
        kwargs = dict(do_sample=False, guidance_scale=1.5, negative_prompt_ids=negative)
        _assert_matches(_generate(model, prompt()[:1], **kwargs), _generate(reference, prompt()[:1], **kwargs))


def test_num_return_sequences_matches_transformers(models):
    """Several samples of one prompt: generate() makes the cache batch * num_return_sequences rows."""
    reference, model = models
    results = []
    for served in (reference, model):
        torch.manual_seed(7)
        results.append(_generate(served, prompt()[:1], do_sample=True, num_return_sequences=2))
    _assert_matches(results[1], results[0])
    assert results[0][0].shape[0] == 2 and not torch.equal(results[0][0][0], results[0][0][1])


def test_generate_refuses_by_name(models):
    reference, model = models
    input_ids = prompt()
    with pytest.raises(ValueError, match="num_beams=2: beam search reorders the cache's rows"):
        model.generate(input_ids, num_beams=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="num_beams=2: beam search"):
        model.generate(input_ids, num_beams=2, num_return_sequences=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="use_cache=False: generate.. would run every step over the whole sequence"):
        model.generate(input_ids, use_cache=False, max_new_tokens=2, do_sample=False)
    with torch.no_grad():  # a step without a cache: transformers' forward over the whole prompt
        for length in (3, 5):
            got = model(input_ids[:, :length], use_cache=False).logits
            assert float((got - reference(input_ids[:, :length], use_cache=False).logits).abs().max()) < 1e-5
    with pytest.raises(ValueError, match="use_cache=False with a cache"):
        model(input_ids, use_cache=False, **{model.cache_kwarg: model.new_cache(2, WIDTH)})
    with pytest.raises(ValueError, match=r"input_ids of dtype torch.float32: token ids are an integer tensor"):
        model(input_ids.float())
    bad = input_ids.clone()
    bad[1, 2] = model.config.vocab_size
    with pytest.raises(ValueError, match=r"input_ids\[1, 2\] = 64: token ids lie in \[0, vocab_size 64\)"):
        model(bad)
    with pytest.raises(ValueError, match=r"the cache has 1 rows, this step 2: .*batch \* num_return_sequences rows"):
        model(input_ids, **{model.cache_kwarg: model.new_cache(1, WIDTH)})


def test_generate_without_an_attention_mask_sees_the_padding(models):
    """apply keeps the wrapped forward's signature: generate() builds the attention mask from the
    pad token (a left-padded batch used to run unmasked and give other tokens than transformers)
    and asks for the last position's logits only."""
    import inspect

    reference, model = models
    assert {"attention_mask", "logits_to_keep"} <= set(inspect.signature(model.model.forward).parameters)
    reference, model = copy.deepcopy(reference), dcp_compile.apply(copy.deepcopy(reference), dcp_size=1)
    for config in (reference.config, reference.generation_config, model.model.config, model.model.generation_config):
        config.pad_token_id = 0
    input_ids = prompt().clamp(min=1)
    _assert_matches(_generate(model, input_ids, do_sample=False), _generate(reference, input_ids, do_sample=False))
    padded = input_ids.clone()
    padded[1, :2] = 0  # left padding, which generate() masks from the pad token
    _assert_matches(_generate(model, padded, do_sample=False), _generate(reference, padded, do_sample=False))


def test_a_thousand_prompt_lengths_compile_two_graphs():
    """Every prompt length and cache width runs through one prefill graph and one decode graph
    (before, each length compiled its own, and the 257th raised dynamo's FailOnRecompileLimitHit);
    the tokens are transformers' at a sample of the lengths, rows of 1 and 3."""
    from tests.hf.models import tiny_model

    reference = tiny_model(max_position_embeddings=1024, num_attention_heads=2, num_key_value_heads=2)  # 2 heads: 30% less time
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=1, kv_capacity=4096)
    generator = torch.Generator().manual_seed(3)
    compared = 0
    with torch.no_grad():
        for length in range(1, 1001):
            rows = 3 if length % 100 == 7 else 1
            input_ids = torch.randint(0, 64, (rows, length), generator=generator)
            tokens = model.generate(input_ids, max_new_tokens=2, do_sample=False)
            if length <= 3 or length % 50 == 7:
                assert torch.equal(tokens, reference.generate(input_ids, max_new_tokens=2, do_sample=False)), length
                compared += 1
    assert compared == 23
    state = dcp_compile.state(model)
    graphs = len(state.reports)
    assert graphs <= 4, graphs  # (1 row | 3 rows) x (prefill | one-token decode)
    assert state.pass_summary()["absorb_mla"] == 2 * graphs  # symbolic sizes: every layer still absorbed


def test_what_a_new_user_tries_is_served_or_refused_by_name(models):
    """generate(inputs=...), generate() and beam search on the object passed to apply, torch.compile
    around the applied model, hidden states and attention weights, use_cache=False from a saved
    generation config, dynamic NTK rope: each served as transformers serves it, or refused by name
    before any step (they used to give dynamo's own errors, a transformers-cache error, or, under
    an outer compile, a step that was no longer DCP's)."""
    from tests.hf.models import tiny_model

    reference, model = models
    input_ids = prompt()
    want = _generate(reference, input_ids, do_sample=False)
    _assert_matches(_generate(model, None, inputs=input_ids, do_sample=False), want)
    _assert_matches(_generate(model.model, input_ids, do_sample=False), want)  # apply's argument is the DCP model
    with pytest.raises(ValueError, match="num_beams=2: beam search reorders the cache's rows"):
        model.model.generate(input_ids, num_beams=2, max_new_tokens=2)
    outer = torch.compile(model)
    with torch.no_grad():
        got, expected = outer(input_ids).logits, reference(input_ids).logits
    assert float((got - expected).abs().max()) < 1e-5
    for name, why in (("output_hidden_states", "hooks on the decoder layers"),
                      ("output_attentions", "never forms per-head attention weights")):
        with pytest.raises(ValueError, match=f"{name}=True: .*{why}"):
            model.generate(input_ids, max_new_tokens=2, return_dict_in_generate=True, **{name: True})
        with pytest.raises(ValueError, match=f"{name}=True"):
            model(input_ids, **{name: True})
    saved = copy.deepcopy(model.model.generation_config)
    model.model.generation_config.use_cache = False
    try:
        with pytest.raises(ValueError, match=r"use_cache=False \(from the model's generation_config"):
            model.generate(input_ids, max_new_tokens=2)
    finally:
        model.model.generation_config = saved
    dynamic = tiny_model(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"rope_type 'dynamic' \(dynamic NTK\) .* a branch on the data"):
        dcp_compile.apply(dynamic, dcp_size=1)


def _left_padded(lengths, vocab=64, seed=4):
    """Prompts of `lengths`, left-padded with token 0 into one batch: (prompts, input_ids, mask)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(prompts):
        input_ids[row, width - len(tokens):], mask[row, width - len(tokens):] = tokens, 1
    return prompts, input_ids, mask


def test_a_left_padded_batch_gives_each_row_its_own_tokens():
    """Prompts of 1, 7 and 20 tokens in one left-padded batch: each row's padding is its own
    length in the cache (never written, positions after it), so every row gets the tokens and
    logits transformers gives the padded batch, and those of its prompt alone; with the mask
    passed, and built by generate() from the pad token. Every layer runs the absorbed attention.
    A mask that is not left padding is refused by name (it used to refuse every padded batch)."""
    from tests.hf.models import tiny_model

    reference = tiny_model()
    for config in (reference.config, reference.generation_config):
        config.pad_token_id = 0
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=1, kv_capacity=256)
    prompts, input_ids, mask = _left_padded((1, 7, 20))
    want = _generate(reference, input_ids, attention_mask=mask, do_sample=False)
    _assert_matches(_generate(model, input_ids, attention_mask=mask, do_sample=False), want)
    _assert_matches(_generate(model, input_ids, do_sample=False), want)
    for row, tokens in enumerate(prompts):
        alone = _generate(reference, tokens[None], do_sample=False)
        assert torch.equal(alone[0][0, len(tokens):], want[0][row, input_ids.shape[1]:])
        assert float((alone[1][:, 0] - want[1][:, row]).abs().max()) < 1e-5
    state = dcp_compile.state(model)
    assert state.pass_summary()["absorb_mla"] == 2 * len(state.reports)  # 2 layers in every graph
    right_padded = mask.flip(1)
    with pytest.raises(ValueError, match=r"a DCP step serves left padding only .*padding_side='left'"):
        model.generate(input_ids.flip(1), attention_mask=right_padded, max_new_tokens=2, do_sample=False)
