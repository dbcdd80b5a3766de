"""transformers' assisted generation (`assistant_model=`) and prompt lookup
(`prompt_lookup_num_tokens=`) through the transformers front end: DeepSeek-V3 tiny at DCP 2 on 2
gloo ranks and at dcp_size 1 in process give transformers' own tokens, greedy and sampled with
one seed, with drafts accepted (fewer target steps than new tokens, as many as transformers'
own target forwards). The target verifies each draft in one step and the DCP cache is cropped
back to the accepted tokens (dcp_compile/hf/cache.py, DCPCache.crop).

The assistant is the target's first layer (its embedding, first decoder layer, norm and head as a
1-layer DeepSeek-V3), so that its drafts agree with the target often enough to be accepted: a
plain transformers model (replicated on every rank, its own DynamicCache), or one applied with
dcp_compile at the same dcp_size (its cache sharded like the target's). A batch of 2 rows is
refused on every rank, as transformers refuses assisted generation with batch > 1, and the model
serves the next call.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import dcp_compile  # noqa: E402
from dcp_compile.hf.cache import DCPCache  # noqa: E402
from dcp_compile.runtime.kv_pool import MLAKVPool  # noqa: E402
from dcp_compile.runtime.launch import spawn  # noqa: E402
from tests.hf.models import HYBRID, available, tiny_model  # noqa: E402

NEW_TOKENS = 16
PROMPT = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]])
"""Repetitive: prompt lookup finds n-grams to draft from."""
SEED = 7
TIMEOUT_S = 60.0
MODES = {"prompt_lookup": {"prompt_lookup_num_tokens": 3}, "assistant": {}, "dcp_assistant": {}}


def first_layer_assistant(target):
    """A 1-layer DeepSeek-V3 with the target's embedding, first decoder layer, norm and head."""
    assistant = tiny_model(num_hidden_layers=1)
    missing = assistant.load_state_dict(target.state_dict(), strict=False).missing_keys
    assert not missing, missing
    return assistant


def _outcome(call):
    try:
        return ("ok", call())
    except Exception as exc:  # the error each rank met, asserted by the tests
        return (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def _counting_forwards(model):
    """A forward pre-hook counting `model`'s forward calls: the returned list's first item."""
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _counting_steps(applied):
    """The DCP target's steps (each a forward of transformers' generate), counted."""
    calls, step = [0], applied._step

    def counted(*args, **kwargs):
        calls[0] += 1
        return step(*args, **kwargs)

    applied._step = counted
    return calls


def _generate(model, calls, mode: str, assistant, sample: bool, input_ids=PROMPT) -> dict:
    """One generate() of `mode`: its tokens and the target's forwards (steps) it took."""
    kwargs = dict(MODES[mode])
    if mode != "prompt_lookup":
        kwargs["assistant_model"] = assistant
    before = calls[0]
    if sample:
        torch.manual_seed(SEED)
    with torch.no_grad():
        tokens = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=sample, **kwargs)
    return dict(tokens=tokens.tolist(), forwards=calls[0] - before)


def run_modes(world: int) -> dict:
    """Every mode, greedy and sampled, through a DeepSeek-V3 tiny applied at dcp_size `world`
    (on this rank), each against the untouched model's generate() of the same mode; then a batch
    of two rows, and the next call."""
    reference = tiny_model()
    reference_forwards = _counting_forwards(reference)
    plain_assistant = first_layer_assistant(reference)
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=world)
    steps = _counting_steps(model)
    dcp_assistant = dcp_compile.apply(first_layer_assistant(reference), dcp_size=world)
    assistant_steps = _counting_steps(dcp_assistant)
    results = {}
    for mode in MODES:
        assistant = dcp_assistant if mode == "dcp_assistant" else plain_assistant
        for sample in (False, True):
            want = _generate(reference, reference_forwards, "assistant" if mode == "dcp_assistant" else mode,
                             plain_assistant, sample)
            got = _outcome(lambda: _generate(model, steps, mode, assistant, sample))
            results[mode, sample] = dict(want=want, got=got)
    results["dcp_assistant_steps"] = assistant_steps[0]
    two_rows = torch.cat([PROMPT, PROMPT.flip(1)])
    results["two_rows"] = dict(
        want=_outcome(lambda: _generate(reference, reference_forwards, "prompt_lookup", None, False, two_rows)),
        got=_outcome(lambda: _generate(model, steps, "prompt_lookup", None, False, two_rows)),
        after=_outcome(lambda: _generate(model, steps, "prompt_lookup", None, False)),
        want_after=_generate(reference, reference_forwards, "prompt_lookup", None, False))
    return results


def hybrid_runs(world: int) -> dict:
    """Kimi-Linear tiny (KDA and MLA layers) at dcp_size `world` with prompt lookup (its drafts
    are all rejected: this model does not repeat itself) and with an assistant made of its first
    KDA and MLA layers (drafts of 3 tokens, some accepted), against the untouched model's greedy
    decoding without assistance."""
    reference = tiny_model(family="kimi-linear")
    kinds = HYBRID["layer_types"][:2], HYBRID["mlp_layer_types"][:2]
    assistant = tiny_model(family="kimi-linear", num_hidden_layers=2, layer_types=kinds[0], mlp_layer_types=kinds[1])
    assert not assistant.load_state_dict(reference.state_dict(), strict=False).missing_keys
    assistant.generation_config.num_assistant_tokens = 3
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=world)
    steps = _counting_steps(model)
    with torch.no_grad():
        plain = reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    return dict(plain=plain, prompt_lookup=_outcome(lambda: _generate(model, steps, "prompt_lookup", None, False)),
                assistant=_outcome(lambda: _generate(model, steps, "assistant", assistant, False)))


def assisted_runs(rank: int, world: int) -> dict:
    results = run_modes(world)
    if available("kimi-linear"):
        results["hybrid"] = hybrid_runs(world)
    return results


@pytest.fixture(scope="module")
def ranks():
    return spawn(assisted_runs, 2, timeout=TIMEOUT_S)


def _check_mode(results: dict, mode: str, sample: bool) -> None:
    result = results[mode, sample]
    assert result["got"][0] == "ok", result["got"]
    got, want = result["got"][1], result["want"]
    assert got["tokens"] == want["tokens"]
    assert got["forwards"] == want["forwards"]
    if not sample:  # drafts were accepted: fewer verify steps than new tokens
        assert got["forwards"] < NEW_TOKENS, got


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", list(MODES))
def test_assisted_generate_at_dcp_two_gives_transformers_tokens(ranks, mode, sample):
    """Before, the target's modes failed on every rank with transformers' "Assisted decoding
    requires a cache that can be cropped to restore the states after draft verification", and a
    DCP assistant with "'DCPTransformersModel' object has no attribute 'device'". A DCP
    assistant's sampled run failed on every rank ("the DCP ranks were given different generate()
    calls") while its generate() restored the ranks' own random generators inside its target's
    shared ones (hf/agreement.py, shared_generators)."""
    for rank in ranks:
        _check_mode(rank, mode, sample)
        assert rank["dcp_assistant_steps"] > 0  # the DCP assistant drafted through its own DCP steps


def test_two_rows_are_refused_on_every_rank_and_the_model_serves_on(ranks):
    for rank in ranks:
        result = rank["two_rows"]
        assert result["want"][0] == "ValueError"  # transformers' own refusal
        assert result["got"][0] == "ValueError" and "one row" in result["got"][1], result["got"]
        assert result["after"] == ("ok", result["want_after"])


@pytest.mark.skipif(not available("kimi-linear"), reason="Kimi-Linear needs transformers 5.25")
def test_hybrid_assisted_generate_at_dcp_two_gives_the_plain_greedy_tokens(ranks):
    """The KDA layers' states are restored by transformers' own crop, from one more recorded state
    than transformers 5.25 keeps (DCPCache.activate_past_recording): the tokens are those of
    greedy decoding without assistance, with drafts all rejected (prompt lookup) and some
    accepted (the assistant). transformers 5.25's own prompt lookup on this model parts from them
    at the second new token: after a wholly rejected draft it restores the state from before
    the verify step."""
    for rank in ranks:
        result = rank["hybrid"]
        for mode in ("prompt_lookup", "assistant"):
            assert result[mode][0] == "ok", (mode, result[mode])
            assert result[mode][1]["tokens"] == result["plain"], mode
        assert result["assistant"][1]["forwards"] < NEW_TOKENS


def test_assisted_generate_at_dcp_one_gives_transformers_tokens():
    results = run_modes(1)
    for mode in MODES:
        for sample in (False, True):
            _check_mode(results, mode, sample)
    assert results["two_rows"]["got"][0] == "ValueError"
    assert results["two_rows"]["after"] == ("ok", results["two_rows"]["want_after"])


def _written(cache: DCPCache, columns: int) -> None:
    """What a step of `columns` columns leaves: every attention layer's counter and the host's."""
    for layer in cache.attention_layers():
        layer.cumulative_length.add_(columns)
    cache.advance(columns)


def test_crop_moves_the_length_back_on_the_host_and_in_every_layer():
    pool = MLAKVPool(2, 64, 16, 8, torch.float32, "cpu")
    cache = DCPCache(pool, 2, 10)
    table, code = cache.req_to_token.clone(), cache.locations_code
    assert cache.is_croppable
    _written(cache, 7)
    cache.crop(-3)  # transformers 5.18+: a negative count to remove
    assert cache.length() == cache.get_seq_length() == 4
    assert [int(layer.cumulative_length) for layer in cache.attention_layers()] == [4, 4]
    cache.crop(0)
    cache.crop(6)  # before 5.18: the length to keep, a longer one leaving the cache as it is
    assert cache.length() == 4
    cache.crop(2)
    assert cache.length() == 2 and int(cache.attention_layers()[1].cumulative_length) == 2
    assert torch.equal(cache.req_to_token, table) and cache.locations_code == code  # no location moves
    with pytest.raises(ValueError, match="fewer than the 3 to remove"):
        cache.crop(-3)
    assert cache.length() == 2


def test_crop_keeps_each_rows_padding_and_clears_it_at_zero():
    pool = MLAKVPool(1, 64, 16, 8, torch.float32, "cpu")
    cache = DCPCache(pool, 2, 10)
    cache.set_padding([0, 3])
    _written(cache, 6)
    with pytest.raises(ValueError, match="inside a row's left padding"):
        cache.crop(-4)
    assert cache.length() == 6
    cache.crop(-3)
    assert cache.length() == 3 and cache.pads == [0, 3]
    cache.crop(-3)
    assert cache.length() == 0 and cache.pads == [0, 0] and not bool(cache.pad_tensor.any())


def test_a_hybrid_cache_records_one_more_state_than_the_draft_and_crops_only_while_recording():
    pool = MLAKVPool(1, 64, 16, 8, torch.float32, "cpu")
    cache = DCPCache(pool, 1, 10, layer_types=["linear_attention", "full_attention"])
    _written(cache, 4)
    with pytest.raises(ValueError, match="records its past"):
        cache.crop(-1)
    assert cache.length() == 4
    cache.activate_past_recording(recurrent_states_to_keep=3)
    assert cache.layers[0].record_past and cache.layers[0].recurrent_states_to_keep == 4
