"""The failure rule on 2 gloo ranks, for the transformers front end (docs/failures.md): an error
every rank raises alike before any collective of the step (an input check, a refusal, a failed
agreement) leaves the model serving; an error one rank meets after the step's collectives began
stops the model on every rank; what the group must agree on (KV locations, the tokens generate()
returns) is agreed.

One launch; each case is a fresh model, so that one case's latch cannot hide another's result:
- KV locations: a cache held by a reference cycle and collected on rank 0 only, then a generate():
  its cache takes the same locations on both ranks, and transformers' tokens;
- refusals (a mask with holes, an out-of-vocabulary id, float ids, a released cache, an
  out-of-vocabulary id on rank 1 only): a ValueError on every rank, and the next generate() is
  transformers';
- a rank-local failure after a step's collectives (rank 1), then generate() again: the latch's
  error on every rank, no collective mismatch;
- a logits processor that differs by rank at the last token: a ValueError on every rank, and the
  model serves the next call.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

pytest.importorskip("transformers")

import dcp_compile  # noqa: E402
from dcp_compile.runtime.launch import spawn  # noqa: E402
from tests.hf.models import prompt, tiny_model  # noqa: E402

NEW_TOKENS = 6
WIDTH = 16
TIMEOUT_S = 30.0
LATCHED = "an earlier step failed"


def _outcome(call) -> tuple:
    try:
        result = call()
        return ("ok", result)
    except Exception as exc:  # the error each rank met, asserted by the tests
        return (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def _tokens(model, input_ids, **kwargs) -> list:
    with torch.no_grad():
        return model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs).tolist()


def _locations(reference, rank: int, world: int) -> dict:
    """Two generate() calls; between them rank 0 alone collects a cache left in a reference cycle."""
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=world)
    gc.disable()
    try:
        held = model.new_cache(1, WIDTH - 1)  # the next cache starts at another owner (location parity)
        _tokens(model, prompt(1)[:1], **{model.cache_kwarg: held})
        cycle = [held]
        cycle.append(cycle)
        del held, cycle
        if rank == 0:
            gc.collect()
        second = prompt(2)[:1]
        cache = model.new_cache(1, WIDTH)
        tokens = _outcome(lambda: _tokens(model, second, **{model.cache_kwarg: cache}))
        locations = cache.req_to_token[0].tolist()
    finally:
        gc.enable()
    return dict(tokens=tokens, want=_tokens(reference, second), locations=locations)


def _refusals(reference, rank: int) -> dict:
    """Inputs every rank (or one rank) refuses, each followed by a good generate()."""
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=2)
    vocab = reference.config.vocab_size
    input_ids = prompt(1)[:1]
    released = model.new_cache(1, WIDTH)
    released.release()
    holes = torch.ones_like(input_ids)
    holes[0, 2] = 0
    bad_calls = {
        "mask_with_holes": lambda: _tokens(model, input_ids, attention_mask=holes),
        "out_of_vocabulary": lambda: _tokens(model, torch.full_like(input_ids, vocab)),
        "float_ids": lambda: model(input_ids.float(), **{model.cache_kwarg: model.new_cache(1, WIDTH)}),
        "released_cache": lambda: model(input_ids, **{model.cache_kwarg: released}),
        "out_of_vocabulary_on_rank_1": lambda: model(torch.full_like(input_ids, vocab) if rank == 1 else input_ids,
                                                     **{model.cache_kwarg: model.new_cache(1, WIDTH)}),
    }
    want = _tokens(reference, input_ids)
    results = {}
    for name, call in bad_calls.items():
        results[name] = (_outcome(call), _outcome(lambda: _tokens(model, input_ids)))
    return dict(results=results, want=want)


def _failure_after_collectives(reference, rank: int) -> list:
    """Rank 1 fails a step of a sampling generate() after the step's collectives (its cache's
    host counter raises); both ranks then call generate() twice more."""
    from dcp_compile.hf.cache import DCPCache

    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=2)
    input_ids = prompt(1)[:1]
    advance = DCPCache.advance
    calls = [0]

    def failing_advance(self, tokens):
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            raise RuntimeError("injected failure on rank 1")
        return advance(self, tokens)

    DCPCache.advance = failing_advance
    try:
        outcomes = []
        for _ in range(3):
            torch.manual_seed(0)
            with torch.no_grad():
                outcomes.append(_outcome(lambda: model.generate(input_ids, max_new_tokens=NEW_TOKENS,
                                                                do_sample=True).tolist()))
    finally:
        DCPCache.advance = advance
    return outcomes


def _last_token_by_rank(reference, rank: int) -> dict:
    """A logits processor that, on rank 1 only, bans the best token of the last step."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=2)
    input_ids = prompt(1)[:1]

    class RankDependent(LogitsProcessor):
        def __call__(self, ids, scores):
            if rank == 1 and ids.shape[1] == input_ids.shape[1] + NEW_TOKENS - 1:
                scores = scores.clone()
                scores[:, scores.argmax(-1)] = -float("inf")
            return scores

    differing = _outcome(lambda: _tokens(model, input_ids, logits_processor=LogitsProcessorList([RankDependent()])))
    return dict(differing=differing, after=_outcome(lambda: _tokens(model, input_ids)),
                want=_tokens(reference, input_ids))


def failure_rule(rank: int, world: int) -> dict:
    reference = tiny_model()
    return dict(locations=_locations(reference, rank, world), refusals=_refusals(reference, rank),
                failure=_failure_after_collectives(reference, rank), last_token=_last_token_by_rank(reference, rank))


@pytest.fixture(scope="module")
def ranks():
    return spawn(failure_rule, 2, timeout=TIMEOUT_S)


def test_a_cache_takes_the_same_kv_locations_on_every_rank(ranks):
    """Before, rank 0 reused the collected cache's locations and rank 1 took new ones: both ranks
    returned other tokens than transformers, with no error."""
    first, second = (rank["locations"] for rank in ranks)
    assert first["locations"] == second["locations"]
    for result in (first, second):
        assert result["tokens"] == ("ok", result["want"])


def test_refused_input_raises_on_every_rank_and_leaves_the_model_serving(ranks):
    """Before, every refusal stopped the model ("an earlier step failed ... restart the ranks")."""
    for rank in ranks:
        for name, (refused, after) in rank["refusals"]["results"].items():
            assert refused[0] == "ValueError", (name, refused)
            assert after == ("ok", rank["refusals"]["want"]), (name, after)
    one_rank = [rank["refusals"]["results"]["out_of_vocabulary_on_rank_1"][0][1] for rank in ranks]
    assert "token ids lie in" in one_rank[1]
    assert "DCP rank 1 refused this step" in one_rank[0]


def test_a_rank_local_failure_stops_every_rank_with_the_latchs_error(ranks):
    """Before, rank 1's retry of generate() ran its agreement and generator broadcast before the
    latch: a collective mismatch (gloo SIGABRT), not the latch's error."""
    failed, peer = ranks[1]["failure"], ranks[0]["failure"]
    assert failed[0] == ("RuntimeError", "injected failure on rank 1")
    assert peer[0][0] == "PeerFailedError" and "DCP rank 1 failed a step" in peer[0][1]
    for outcome in failed[1:] + peer[1:]:
        assert outcome[0] == "RuntimeError" and LATCHED in outcome[1], outcome
    assert "on DCP rank 1" in peer[1][1]


def test_final_tokens_that_differ_by_rank_are_an_error_on_every_rank(ranks):
    """Before, rank 1 returned another last token than rank 0, with no error."""
    for rank in ranks:
        result = rank["last_token"]
        assert result["differing"][0] == "ValueError" and "different tokens" in result["differing"][1]
        assert result["after"] == ("ok", result["want"])
