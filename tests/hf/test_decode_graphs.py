"""generate()'s decode steps replayed from device graphs (dcp_compile/hf/graphs.py), on 2 ranks of
the emulated npu device (NPU graphs, whose replay runs exactly the recorded ops on the captured
buffers, and refuses host traffic in a capture), with the Triton kernels under the interpreter,
as triton-ascend would run them there.

DeepSeek-V3 tiny at DCP 2, dense layers (transformers' MoE counts tokens with histc on integers,
which has no CPU kernel, and the emulator runs CPU kernels): batches of 2 and 1 rows, a
left-padded batch of prompts of 1, 7 and 20 tokens, and a second batch of 2 rows that replays the
graph captured for the first: transformers' tokens, logits within 1e-5 in fp32, and bf16 under the
near-tie rule (BF16_LOGITS); every decode step replayed, one graph per batch size.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from dcp_compile.runtime.launch import spawn  # noqa: E402

NEW_TOKENS = 5
LENGTHS = (1, 7, 20)
BF16_LOGITS = 0.2
"""bf16's logit tolerance: the tiny model's logits reach about 10 (initializer_range 0.2), where a
bf16 step is 0.06; the absorbed and the expanded attention round apart by up to 0.1 here."""


def rank_generates(rank: int, world: int, dtype: torch.dtype) -> dict:
    import dcp_compile
    from tests.hf.models import agree_near_ties, prompt, tiny_model
    from tests.hf.test_caches_and_generate import _left_padded

    device = torch.device("npu", torch.npu.current_device())
    reference = tiny_model(first_k_dense_replace=2).to(dtype)
    model = dcp_compile.apply(copy.deepcopy(reference).to(device), dcp_size=world, kernels="triton", kv_capacity=512)
    model.capture_decode_graphs(batch_sizes=(1, 2, 3), max_length=64)
    _, padded, mask = _left_padded(LENGTHS)
    calls = [(prompt(), {}), (prompt(3)[:1], {}), (padded, {"attention_mask": mask}), (prompt(5), {})]
    results = []
    for input_ids, extra in calls:
        outputs = []
        for served, on in ((model, device), (reference, torch.device("cpu"))):
            with torch.no_grad():
                out = served.generate(input_ids.to(on), **{k: v.to(on) for k, v in extra.items()},
                                      max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
            outputs.append((out.sequences.cpu(), torch.stack(out.logits, 1).cpu()))
        (got, want) = outputs
        try:  # plain values back to the test: tensors in the result queue outlive their rank
            near_tie = ("ok", agree_near_ties(got, want, BF16_LOGITS))
        except AssertionError as exc:
            near_tie = ("failed", repr(exc))
        results.append(dict(tokens_equal=bool(torch.equal(got[0], want[0])), near_tie=near_tie,
                            logits=float((got[1].float() - want[1].float()).abs().max())))
    graphs = model.decode_graphs
    return dict(results=results, replays=graphs.replays, captured=sorted(key[0] for key in graphs.captured),
                compiled=len(dcp_compile.state(model).reports))


def rank_runs(rank: int, world: int) -> dict:
    """Both dtypes in one launch."""
    return {dtype: rank_generates(rank, world, dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.usefixtures("npu_emulator")
def test_generate_replays_decode_graphs_with_transformers_tokens():
    for ranks in spawn(rank_runs, 2, backend="hccl"):
        for dtype, rank in ranks.items():
            for result in rank["results"]:
                assert result["near_tie"][0] == "ok", (dtype, result)
                if dtype == torch.float32:
                    assert result["tokens_equal"] and result["logits"] < 1e-5, result
            _check_graphs(rank)


def _check_graphs(rank: dict) -> None:
    assert rank["replays"] == 4 * (NEW_TOKENS - 1)  # every decode step of the 4 calls
    assert rank["captured"] == [1, 2, 3]  # the second batch of 2 replays the first's graph
    assert rank["compiled"] == 4  # (1 row | more) x (prefill | decode), whatever the lengths and padding
