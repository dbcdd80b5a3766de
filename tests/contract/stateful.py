"""The contract model with state it updates in place inside forward, in every form dynamo
captures: an in-place method and an `out=` call on registered buffers, and an in-place method,
an augmented assignment and an item assignment on tensors passed in. A pass that drops any of
them (FX's dead-code elimination treats methods as pure) leaves the state behind eager's."""

from __future__ import annotations

import torch

from tests.contract.model import ContractModel


class StatefulModel(ContractModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens, positions, seq_ids, out_loc, page_table, lens, steps, last_token, token_counts):
        self.calls.add_(1)  # call_method on a buffer
        torch.add(self.tokens_seen, tokens.shape[0], out=self.tokens_seen)  # call_function, out=, on a buffer
        steps += 1  # call_function (operator.iadd) on an input
        last_token.index_copy_(0, torch.zeros(1, dtype=torch.int64), tokens[-1:])  # call_method on an input
        token_counts[0] = token_counts[0] + tokens.shape[0]  # setitem on an input
        return super().forward(tokens, positions, seq_ids, out_loc, page_table, lens)


def new_state() -> dict[str, torch.Tensor]:
    """The state tensors a caller passes to StatefulModel.forward."""
    return {"steps": torch.zeros(1, dtype=torch.int64), "last_token": torch.zeros(1, dtype=torch.int64),
            "token_counts": torch.zeros(2, dtype=torch.int64)}


def run_steps(model, state: dict, steps: int = 4) -> list[torch.Tensor]:
    """`steps` forwards (a prefill, then decodes) of two requests; returns the logits."""
    from dcp_compile.runtime.batch import RequestTable
    from tests.contract.model import step_args

    table = RequestTable(2, 32, 512)
    logits, tokens = [], [[1, 2, 3], [4]]
    for _ in range(steps):
        batch = table.extend_batch([0, 1], tokens)
        logits.append(model(*step_args(batch), state["steps"], state["last_token"], state["token_counts"]))
        tokens = [[5 + len(logits)], [9 + len(logits)]]
    return logits


def expected_state(steps: int = 4) -> dict[str, list[int]]:
    """What eager gives after run_steps: 4 tokens, then 2 a step."""
    seen = 4 + 2 * (steps - 1)
    return {"calls": [steps], "tokens_seen": [seen], "steps": [steps], "last_token": [9 + steps - 1],
            "token_counts": [seen, 0]}


def observed_state(model, state: dict) -> dict[str, list[int]]:
    inner = model.model if hasattr(model, "model") else model
    return {"calls": [int(inner.calls)], "tokens_seen": [int(inner.tokens_seen)],
            **{name: t.tolist() for name, t in state.items()}}
