"""A model's own state updates survive apply(): in-place methods, out= calls, augmented and item
assignments, on buffers and on inputs, at dcp_size 1 (here) and 2 (test_contract's spawn); and
the verifier fails a pass that drops one."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

import dcp_compile
from dcp_compile.passes import PassConfig, PassManager
from dcp_compile.passes.base import GraphPass
from dcp_compile.passes.manager import default_passes
from dcp_compile.passes.verify import GraphVerificationError
from tests.contract.stateful import StatefulModel, expected_state, new_state, observed_state, run_steps
from tests.harness import capture


def test_eager_gives_the_expected_state():
    model, state = StatefulModel(), new_state()
    run_steps(model, state)
    assert observed_state(model, state) == expected_state()


def test_apply_keeps_every_state_update_at_dcp_size_one():
    eager, eager_state = StatefulModel(), new_state()
    model, state = dcp_compile.apply(StatefulModel(), 1), new_state()
    expected, got = run_steps(eager, eager_state), run_steps(model, state)
    assert observed_state(model, state) == expected_state()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def _graph():
    from dcp_compile.runtime.batch import RequestTable
    from tests.contract.model import step_args

    state = new_state()
    batch = RequestTable(2, 32, 512).extend_batch([0, 1], [[1, 2, 3], [4]])
    return capture(StatefulModel(), *step_args(batch), state["steps"], state["last_token"], state["token_counts"])


def _written(gm: fx.GraphModule) -> list[str]:
    return sorted(str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
                  for n in gm.graph.nodes if n.op in ("call_method", "call_function")
                  and (n.target in ("add_", "index_copy_") or n.target in (operator.iadd, operator.setitem)
                       or "out" in n.kwargs))


@pytest.mark.parametrize("dcp_size", [1, 2])
def test_cleanup_keeps_the_state_updates_in_the_graph(dcp_size):
    gm = _graph()
    before = _written(gm)
    assert before == ["add", "add_", "iadd", "index_copy_", "setitem"]
    PassManager(PassConfig(dcp_size=dcp_size, dcp_group_name="fake" if dcp_size > 1 else None)).run(gm)
    assert _written(gm) == before


class _DropCounter(GraphPass):
    """A faulty pass: erases the buffer counter's add_."""

    name = "drop_counter"

    def run(self, gm, config):
        for node in list(gm.graph.nodes):
            if node.op == "call_method" and node.target == "add_":
                gm.graph.erase_node(node)
                return 1
        return 0


def test_verify_fails_a_pass_that_drops_a_state_update():
    passes = default_passes()
    passes.insert(-2, _DropCounter())
    with pytest.raises(GraphVerificationError, match=r"wrote \['l_self_buffers_calls_'\] in place.*no longer does"):
        PassManager(PassConfig(), passes=passes).run(_graph())
