"""The transformers front end's step runs the compiled-step core (dcp_compile/compiled_step.py) as
the canonical-op model's does: a batch that trips the batch guard (a page-table entry in use
outside the KV pool) fails on every rank of a DCP group, and the step after it is refused by the
failure latch; on a device, where the guard masks the entry and flags it instead of syncing,
the flag is raised at the next step. The steps before run and match the same model at
dcp_size=1.

On the emulated npu device the front end takes kernels='torch' (the torch reference on the
device): 'auto' resolves to the npu back end, whose FIA refuses this fp32 model of latent width
16 by name at apply (tests/hf/test_decode_graphs.py runs FIA's widths). The npu model is dense (no MoE layer):
transformers' grouped-mm experts off the CPU count tokens per expert with an int histc, which
has only a CPU float kernel for the emulated device to run.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dcp_compile  # noqa: E402
from dcp_compile.runtime.launch import spawn  # noqa: E402
from tests.hf.models import PROMPT, prompt, tiny_model  # noqa: E402

MAX_LENGTH = 8
BAD_POSITION = 2
"""A prompt position, in use by every later step: its page-table entry is set outside the pool."""
LATCHED = "an earlier step failed on this rank"


def _model(device_type: str):
    return tiny_model(**({} if device_type == "cpu" else {"first_k_dense_replace": 2}))


def _outcome(step) -> tuple:
    try:
        logits = step()
        return ("ok", bool(torch.isfinite(logits).all()))
    except Exception as exc:  # the error each rank met, asserted by the tests
        return (type(exc).__name__, str(exc).splitlines()[0])


def guarded_steps(rank: int, world: int, device_type: str) -> dict:
    """Prefill and a decode step of a DCP model and of the same model at dcp_size=1, then a
    decode step whose page table has an entry outside the pool (DCP model only), then two good
    steps. Returns the largest logits difference of the good steps and each later step's outcome."""
    device = torch.device("cpu") if device_type == "cpu" else torch.device("npu", torch.npu.current_device())
    kernels = "auto" if device_type == "cpu" else "torch"
    auto_refused = None
    if device_type != "cpu":
        try:
            dcp_compile.apply(_model(device_type).to(device), dcp_size=world)
        except ValueError as exc:
            auto_refused = str(exc)
    dcp = dcp_compile.apply(_model(device_type).to(device), dcp_size=world, kernels=kernels)
    reference = dcp_compile.apply(_model(device_type).to(device), dcp_size=1, kernels=kernels)
    models = (dcp, reference)
    caches = [model.new_cache(PROMPT[0], MAX_LENGTH) for model in models]

    def step(model, cache, input_ids):
        with torch.no_grad():
            return model(input_ids, **{model.cache_kwarg: cache}).logits[:, -1]

    input_ids, worst = prompt().to(device), 0.0
    for _ in range(2):  # prefill, decode
        logits = [step(model, cache, input_ids) for model, cache in zip(models, caches)]
        worst = max(worst, float((logits[0] - logits[1]).abs().max()))
        input_ids = logits[1].argmax(-1, keepdim=True)
    table = caches[0].layers[0].req_to_token  # every layer's
    entry = int(table[0, BAD_POSITION])
    table[0, BAD_POSITION] = dcp.dcp_state.kv_pool.capacity + 7
    bad = _outcome(lambda: step(dcp, caches[0], input_ids))
    table[0, BAD_POSITION] = entry
    after = [_outcome(lambda: step(dcp, caches[0], input_ids)) for _ in range(2)]
    return dict(worst=worst, bad=bad, after=after, auto_refused=auto_refused, dcp_size=dcp.dcp_state.config.dcp_size,
                kernels=dcp.dcp_state.lowering.name)


def _check_good_steps(result: dict) -> None:
    assert result["dcp_size"] == 2 and result["kernels"] == "torch"
    assert result["worst"] < 1e-5


def test_a_tripped_batch_guard_fails_every_rank_and_latches_on_cpu():
    """On the CPU the guard raises at once, on every rank (each checks the whole, replicated
    batch); the next step is refused by the latch, whatever its batch."""
    for result in spawn(guarded_steps, 2, "cpu"):
        _check_good_steps(result)
        assert result["bad"][0] == "IndexError" and f"page-table entry [0, {BAD_POSITION}]" in result["bad"][1]
        for outcome in result["after"]:
            assert outcome[0] == "RuntimeError" and LATCHED in outcome[1] and "IndexError" in outcome[1]


@pytest.mark.usefixtures("npu_emulator")
def test_a_tripped_batch_guard_is_flagged_raised_at_the_next_step_and_latches_on_the_npu():
    """On the npu device the guard masks the entry and sets a device flag, without a host sync:
    the bad step returns, the next one raises the flag on every rank, and the one after is
    refused by the latch."""
    for result in spawn(guarded_steps, 2, "npu", backend="hccl"):
        assert "kernels='npu'" in result["auto_refused"] and "kv_lora_rank 512" in result["auto_refused"]
        _check_good_steps(result)
        assert result["bad"] == ("ok", True)
        raised, refused = result["after"]
        assert raised[0] == "IndexError" and "page-table entry in use outside the pool" in raised[1]
        assert refused[0] == "RuntimeError" and LATCHED in refused[1]


def test_at_dcp_size_one_the_flag_is_raised_and_the_model_runs_on(npu_emulator):
    """No peers, no latch: after the flagged step's error the model serves the next step, as the
    canonical-op model does (tests/test_batch_guard.py)."""
    model = dcp_compile.apply(_model("npu").to(npu_emulator), dcp_size=1, kernels="torch")
    input_ids = prompt()

    def step(cache, ids):
        with torch.no_grad():
            return model(ids.to(npu_emulator), **{model.cache_kwarg: cache}).logits.cpu()

    cache = model.new_cache(PROMPT[0], MAX_LENGTH)
    step(cache, input_ids)
    table = cache.layers[0].req_to_token
    table[0, BAD_POSITION] = model.dcp_state.kv_pool.capacity + 7
    assert torch.isfinite(step(cache, input_ids[:, :1])).all()
    with pytest.raises(IndexError, match="page-table entry in use outside the pool"):
        step(cache, input_ids[:, 1:2])
    model.check_errors()  # raised once, and cleared
    logits = step(model.new_cache(PROMPT[0], MAX_LENGTH), input_ids)
    with torch.no_grad():
        expected = _model("npu")(input_ids).logits
    assert float((logits - expected).abs().max()) < 1e-5
