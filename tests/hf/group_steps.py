"""What one rank of a DCP group runs for test_transformers_distributed.py's caches, sampling and
agreement tests, each against the untouched transformers model (run on the rank itself).
Module-level, so that spawned ranks can import it.

Every DCP step here is generate()'s, of batch 1 over a cache of WIDTH positions (a prompt of 5,
then 11 new tokens): one prefill and one decode graph serve them all, and one more guidance's
unconditional steps."""

from __future__ import annotations

import copy

import torch

import dcp_compile
from tests.hf.models import available, prompt, rank_compare, tiny_model

WIDTH = 16
NEW_TOKENS = WIDTH - 5
SEED = 100
GUIDANCE = 1.5
POOL_LOCATIONS = 2 * 65 - 1
"""The pool's locations at DCP 2: apply's default of 1 + max_position_embeddings rows per rank,
twice over, less location 0."""
LARGE = 100
"""Positions of a cache that fits the pool alone, not beside two caches of WIDTH."""


def _outcome(call) -> tuple:
    try:
        call()
        return ("ok", "")
    except Exception as exc:  # the error each rank met, asserted by the tests
        return (type(exc).__name__, str(exc))


def _generate(model, input_ids, **kwargs):
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=NEW_TOKENS, output_logits=True, output_scores=True,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits), torch.stack(out.scores)


def _difference(got, want) -> dict:
    """Token equality and the largest logits / scores difference of two _generate results."""
    tokens_equal = bool(torch.equal(got[0], want[0]))
    return dict(tokens_equal=tokens_equal,
                logits=float((got[1] - want[1]).abs().max()) if tokens_equal else float("inf"),
                # -inf where a processor masked a token (top-k) in both: inf - inf is nan, taken as equal
                scores=float((got[2] - want[2]).nan_to_num(nan=0.0).abs().max()) if tokens_equal else float("inf"))


def group_steps(rank: int, world: int) -> dict:
    """Two conversations interleaved (each generate() with a cache of its own, the second run
    while the first's cache is live), guidance, sampling after per-rank seeds, then steps the
    ranks disagree on. Returns what each compared or raised."""
    from transformers import LogitsProcessorList

    reference = tiny_model()
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=world)
    first, second = prompt(1)[:1], prompt(2)[:1]
    results = {}

    def interleave(input_ids, scores):
        """After the first conversation's 4th token, the second conversation from start to end."""
        if input_ids.shape[1] == first.shape[1] + 3:
            cache = model.new_cache(1, WIDTH)
            results["second"] = _difference(_generate(model, second, do_sample=False, **{model.cache_kwarg: cache}),
                                            _generate(reference, second, do_sample=False))
            results["too_large"] = _outcome(lambda: model.new_cache(1, LARGE))  # beside the two caches
        return scores

    results["first"] = _difference(_generate(model, first, do_sample=False,
                                             logits_processor=LogitsProcessorList([interleave])),
                                   _generate(reference, first, do_sample=False))
    results["fits_after"] = _outcome(lambda: model.new_cache(1, LARGE).release())  # the two caches were dropped

    # Classifier-free guidance: its unconditional pass calls the model from inside generate().
    results["guidance"] = _difference(_generate(model, first, do_sample=False, guidance_scale=GUIDANCE),
                                      _generate(reference, first, do_sample=False, guidance_scale=GUIDANCE))

    # Sampling after a per-rank seed: every rank draws the first rank's tokens, transformers' with its seed.
    torch.manual_seed(SEED)
    want = _generate(reference, first, do_sample=True)
    state_after_reference = torch.get_rng_state()
    torch.manual_seed(SEED + rank)
    own_state = torch.get_rng_state()
    results["sampling"] = _difference(_generate(model, first, do_sample=True), want)
    results["generator_after_sampling"] = bool(torch.equal(torch.get_rng_state(),
                                                           state_after_reference if rank == 0 else own_state))

    # Steps and generate() calls the ranks disagree on, refused on every rank before anything runs,
    # all on the one model: a refusal leaves it serving (after_refused_calls, below): other token
    # ids, other prompt lengths, one rank in generate() and its peer in a step.
    def disagreeing_step(input_ids):
        with torch.no_grad():
            return _outcome(lambda: model(input_ids, **{model.cache_kwarg: model.new_cache(1, WIDTH)}))

    results["tokens_differ"] = disagreeing_step(torch.tensor([[3 + rank]]))
    results["step_lengths_differ"] = disagreeing_step(first[:, :5 - rank])
    with torch.no_grad():
        cache = model.new_cache(1, WIDTH)  # on every rank: making a cache is a collective under DCP
        results["generate_and_step"] = _outcome(
            lambda: model.generate(first, max_new_tokens=NEW_TOKENS) if rank == 0
            else model(first, **{model.cache_kwarg: cache}))
        del cache
        # A refused generate() call runs no step: the model serves the next one.
        results["prompt_lengths_differ"] = _outcome(lambda: model.generate(first[:, :5 - rank],
                                                                           max_new_tokens=NEW_TOKENS + rank))
        results["sampling_differs"] = _outcome(lambda: model.generate(first, max_new_tokens=NEW_TOKENS,
                                                                      do_sample=rank == 0))
    results["outer_compile"] = _outer_compile(reference, first, world)
    results["left_padded"] = {kernels: _left_padded_batch(world, kernels) for kernels in ("auto", "flashinfer")}
    if available("kimi-linear"):  # a hybrid: its linear-attention layers take the padding mask
        results["left_padded"]["kimi-linear"] = _left_padded_batch(world, "auto", family="kimi-linear")
    results["after_refused_calls"] = _difference(_generate(model, second, do_sample=False),
                                                 _generate(reference, second, do_sample=False))
    return results


def _left_padded_batch(world: int, kernels: str, family: str = "v3") -> dict:
    """Prompts of 1, 7 and 20 tokens in one left-padded batch, the mask built by generate() from
    the pad token: transformers' tokens and logits, and the KV rows this rank stores (the
    padding never written)."""
    from tests.hf.test_caches_and_generate import _left_padded

    reference = tiny_model(family=family)
    for config in (reference.config, reference.generation_config):
        config.pad_token_id = 0
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=world, kv_capacity=256, kernels=kernels)
    _, input_ids, mask = _left_padded((1, 7, 20), vocab=reference.config.vocab_size)
    with torch.no_grad():
        got = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        want = _generate(reference, input_ids, do_sample=False, attention_mask=mask)
    stored = int((dcp_compile.state(model).kv_pool.cache(0) != 0).any(dim=-1).sum())
    return dict(_difference((got.sequences, torch.stack(got.logits), torch.stack(got.logits)),
                            (want[0], want[1], want[1])),
                stored=stored, tokens=int(mask.sum()) + 3 * (NEW_TOKENS - 1))  # the last token is not written


def _outer_compile(reference, input_ids, world: int) -> dict:
    """torch.compile around what apply returned: the DCP step stays DCP's own (it used to be
    inlined into the outer graph, so every rank stored every token). A prefill of 5 tokens and a
    decode step: the logits against transformers', and the KV rows this rank stores."""
    outer = dcp_compile.apply(copy.deepcopy(reference), dcp_size=world)
    compiled = torch.compile(outer)
    cache = outer.new_cache(1, WIDTH)
    with torch.no_grad():
        logits = [compiled(input_ids, **{outer.cache_kwarg: cache}).logits[:, -1],
                  compiled(torch.tensor([[3]]), **{outer.cache_kwarg: cache}).logits[:, -1]]
        want = [reference(input_ids).logits[:, -1], reference(torch.cat([input_ids, torch.tensor([[3]])], 1)).logits[:, -1]]
    stored = int((dcp_compile.state(outer).kv_pool.cache(0) != 0).any(dim=-1).sum())
    return dict(worst=max(float((g - w).abs().max()) for g, w in zip(logits, want)), stored=stored,
                tokens=input_ids.shape[1] + 1)


def rank_runs(rank: int, world: int, cases: list[dict]) -> dict:
    """rank_compare's cases, then group_steps, in one launch."""
    return dict(compare=rank_compare(rank, world, cases), group=group_steps(rank, world))
