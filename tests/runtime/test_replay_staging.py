"""A replayed step syncs the host with the device nowhere in its copies, and copies to the device
only what the captured graph reads (runtime/graph_runner.py, runtime/host_inputs.py):

- host inputs reach the static buffers and a feed's block table through pinned staging buffers,
  which a step reuses only once the copies made from them have completed (an event query that
  does not block; more slots when the host runs ahead);
- a batch input every feed of the captured step reports unread (`HostFeed.unread_inputs`, from
  the `dcp_batch_input` placeholder mark) is not copied;
- `GraphRunner.h2d_last_step` counts what a replay copied host-to-device.

On the emulated npu device, with a hand-built feed and a small step (no model): NPU graphs
capture the step and replay it; eager runs of the same step are the oracle."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from dcp_compile.runtime.batch import ForwardBatch, RequestTable
from dcp_compile.runtime.graph_runner import FEEDS, GraphRunner, NPUGraphs, unread_inputs
from dcp_compile.runtime.host_inputs import BATCH_INPUT, HOST_INPUT, HostFeed, HostInput, HostSlot, PinnedStaging

aten = torch.ops.aten
PAGE = 128


@pytest.fixture(scope="module")
def npu(npu_emulator):
    return npu_emulator


# --- what a replay does on the host ------------------------------------------------------------


class HostTraffic(TorchDispatchMode):
    """Host-to-device copies (pinned and pageable bytes) and device-to-host copies issued under it."""

    def __init__(self):
        super().__init__()
        self.pinned = self.pageable = self.to_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.copy_.default, aten._to_copy.default):
            target_device = args[0].device if func is aten.copy_.default else kwargs.get("device", args[0].device)
            source = args[1] if func is aten.copy_.default else args[0]
            if isinstance(source, torch.Tensor):
                into_device, from_device = torch.device(target_device).type != "cpu", source.device.type != "cpu"
                if into_device and not from_device:
                    nbytes = source.numel() * source.element_size()
                    if source.is_pinned():
                        self.pinned += nbytes
                    else:
                        self.pageable += nbytes
                elif from_device and not into_device:
                    self.to_host += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_waits(monkeypatch):
    """Counts the host's waits for the device: synchronize() of the device, a stream or an event."""
    waits = []
    npu_module = torch.npu
    for owner, name in ((npu_module, "synchronize"), (npu_module.Event, "synchronize"),
                        (npu_module.Stream, "synchronize")):
        original = getattr(owner, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            waits.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    yield waits


# --- PinnedStaging --------------------------------------------------------------------------------


class PendingEvent:
    """An event whose work has not completed (query() is False) until synchronize()."""

    def __init__(self):
        self.done, self.waited = False, 0

    def record(self, stream=None):
        pass

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


def test_host_sources_go_through_pinned_buffers_and_device_sources_do_not(npu):
    staging = PinnedStaging()
    target = torch.zeros(4, 3, dtype=torch.int64, device=npu)
    source = torch.arange(12).view(4, 3)
    on_device = (source + 1).to(npu)
    with HostTraffic() as traffic, staging.step() as copies:
        assert copies.copy("x", target, source) == 96
        assert copies.copy("y", target, on_device) == 0  # device to device
    assert traffic.pageable == 0 and traffic.pinned == 96 and traffic.to_host == 0
    assert copies.h2d_bytes == 96 and torch.equal(target.cpu(), source + 1)
    assert copies.slot.buffers["x"].is_pinned() and "y" not in copies.slot.buffers


def test_a_source_of_fewer_rows_fills_the_first_and_zeroes_the_rest(npu):
    staging = PinnedStaging()
    target = torch.full((4, 3), 7, dtype=torch.int64, device=npu)
    with staging.step() as copies:
        assert copies.copy("x", target, torch.ones(2, 3, dtype=torch.int64)) == 48  # only the rows given cross
    assert target.cpu().tolist() == [[1] * 3, [1] * 3, [0] * 3, [0] * 3]


def test_a_step_without_host_copies_takes_no_slot_and_queries_no_event(npu, monkeypatch):
    """As in a capture (CUDA forbids event queries there): device-to-device copies only."""
    monkeypatch.setattr(torch.npu, "Event", lambda: pytest.fail("an event was made"))
    staging = PinnedStaging()
    target = torch.zeros(3, device=npu)
    with staging.step() as copies:
        copies.copy("x", target, torch.ones(3, device=npu))
    assert copies.slot is None and copies.h2d_bytes == 0 and torch.equal(target.cpu(), torch.ones(3))


def test_two_slots_alternate_and_a_pending_slot_is_never_rewritten(npu, monkeypatch):
    """Double buffering while the device keeps up; a new slot while a slot's copies are pending;
    a wait only with max_slots slots all pending."""
    events = []

    def new_event():
        events.append(PendingEvent())
        return events[-1]

    monkeypatch.setattr(torch.npu, "Event", new_event)
    staging = PinnedStaging(slots=2, max_slots=3)
    target = torch.zeros(2, dtype=torch.int64, device=npu)

    def step(value):
        with staging.step() as copies:
            copies.copy("x", target, torch.full((2,), value))
        return copies.slot

    first = step(1)
    events[-1].done = True
    second = step(2)
    events[-1].done = True
    assert step(3) is first and step(4) is second  # alternating, both events completed
    # the slots of steps 3 and 4 are pending: a third slot, then, at max_slots, a wait for the oldest
    third = step(5)
    assert third not in (first, second) and len(staging) == 3 and staging.waits == 0
    assert first.buffers["x"].tolist() == [3, 3] and second.buffers["x"].tolist() == [4, 4]  # untouched while pending
    assert step(6) is first and staging.waits == 1 and events[2].waited == 1
    assert torch.equal(target.cpu(), torch.full((2,), 6))


# --- HostFeed.unread_inputs -----------------------------------------------------------------------


def feed_graph(rows: int, blocks: int, device, read=("seq_lens", "input_ids")) -> fx.Graph:
    """A lowered graph's placeholders as a lowering leaves them: the batch inputs marked with the
    ForwardBatch field they take (those in `read` used by an op), and host-fed ones tagged."""
    graph = fx.Graph()
    outputs = []
    for name in ("input_ids", "req_to_token", "seq_lens"):
        node = graph.placeholder(f"l_{name}_")
        node.meta[BATCH_INPUT] = name
        if name in read:
            outputs.append(graph.call_function(torch.ops.aten.clone.default, (node,)))
    unmarked = graph.placeholder("l_positions_")  # not marked: taken as read, whether used or not
    del unmarked
    table = graph.placeholder("dcp_block_table")
    table.meta[HOST_INPUT] = HostInput("block_table")
    table.meta["val"] = torch.empty(rows, blocks, dtype=torch.int32, device=device)
    outputs.append(table)
    for b in range(rows):
        length = graph.placeholder(f"dcp_local_len_{b}")
        length.meta[HOST_INPUT] = HostInput("local_len", b)
        outputs.append(length)
    graph.output(tuple(outputs))
    return graph


def test_unread_inputs_are_the_marked_placeholders_without_users(npu):
    feed = HostFeed(feed_graph(2, 4, npu), 0)
    assert feed.unread_inputs() == frozenset({"req_to_token"})
    assert HostFeed(feed_graph(2, 4, npu, read=("req_to_token",)), 0).unread_inputs() == {"input_ids", "seq_lens"}
    other = HostFeed(feed_graph(2, 4, npu, read=("req_to_token", "seq_lens")), 0)
    assert unread_inputs([feed, other]) == frozenset()  # one graph reads it: copied
    assert unread_inputs([feed, HostFeed(feed_graph(2, 4, npu), 0)]) == {"req_to_token"}
    assert unread_inputs([]) == frozenset()  # no feeds: nothing known, everything copied


# --- the runner ------------------------------------------------------------------------------------


class ReportedFeed(HostFeed):
    """A feed whose graph stands for the step below (which reads no page table)."""


def toy_step(slot: HostSlot, feed: HostFeed):
    """A step over ForwardBatch.args() that reads its feed's block table and lengths, and every
    batch input but the page table."""

    def step(input_ids, positions, q_seq_ids, out_loc, req_to_token, seq_lens, state_slots, logits_index):
        table, *lengths = slot.feed(feed)
        per_row = seq_lens * 1000 + table[:, 0].long() * 10 + state_slots
        per_token = input_ids + positions * 3 + out_loc * 7 + per_row.index_select(0, q_seq_ids)
        return per_token.index_select(0, logits_index).float()

    return step


class Served:
    """A request table of 8 rows over `context` tokens, a toy step fed by a feed, and a runner
    replaying it from NPU graphs (emulated)."""

    def __init__(self, npu, context: int, unread: bool = True, rows: int = 8):
        self.device = npu
        self.table = RequestTable(rows, context, PAGE * 64, PAGE)
        blocks = context // PAGE
        graph = feed_graph(rows, blocks, npu, read=("input_ids", "seq_lens") + (() if unread else ("req_to_token",)))
        self.slot = HostSlot(0)
        self.feed = ReportedFeed(graph, 0)
        self.step = toy_step(self.slot, self.feed)
        self.runner = GraphRunner(self.step, buckets=(rows,), graphs=NPUGraphs(), host_slot=self.slot)
        self.requests = list(range(rows - 1))  # one padded row

    def batch(self, step: int) -> ForwardBatch:
        return self.table.extend_batch(self.requests, [[step + r] for r in self.requests])

    def eager(self, batch: ForwardBatch) -> torch.Tensor:
        padded = batch.padded(self.runner.bucket_for(batch.rows), 1)
        self.slot.begin(padded.host)
        try:
            return self.step(*padded.to(self.device).args())[: batch.rows]
        finally:
            self.slot.end()


def test_a_replay_copies_only_through_pinned_memory_and_never_waits(npu, monkeypatch):
    served = Served(npu, context=1024)
    served.runner(served.batch(0))  # capture, then the first replay
    for step in range(1, 4):
        batch = served.batch(step)
        expected = served.eager(batch)
        with host_waits(monkeypatch) as waits, HostTraffic() as traffic:
            out = served.runner(batch)
        assert waits == [] and traffic.pageable == 0 and traffic.to_host == 0
        assert traffic.pinned == served.runner.h2d_bytes_last_step > 0
        assert torch.equal(out.cpu(), expected.cpu())


def test_an_input_no_graph_reads_is_not_copied_at_a_large_width(npu):
    """8 rows x 131072 tokens of context: the page table is 8 MiB a step, the rest a few KiB."""
    context = 131072
    served, copying = Served(npu, context), Served(npu, context, unread=False)
    (captured,) = (served.runner.capture(served.batch(0), 1),)
    assert captured.unread == {"req_to_token"} and copying.runner.capture(copying.batch(0), 1).unread == frozenset()
    for step in range(1, 3):
        batch = served.batch(step)
        out = served.runner(batch)
        assert torch.equal(out.cpu(), served.eager(batch).cpu())
        copying.runner(copying.batch(step))
    copied = served.runner.h2d_last_step
    assert "req_to_token" not in copied and not captured.inputs.req_to_token.any()  # never written since capture
    table_bytes = 8 * (context // PAGE) * 4
    assert copied[FEEDS] == table_bytes and served.runner.h2d_bytes_last_step < 64 * 1024
    full = copying.runner.h2d_last_step
    assert full["req_to_token"] == 7 * context * 8  # the real rows only: the padded row is zeroed on the device
    assert copying.runner.h2d_bytes_last_step - served.runner.h2d_bytes_last_step == full["req_to_token"]
    (static,) = [c.inputs.req_to_token for c in copying.runner.captured.values()]
    assert torch.equal(static[:7].cpu(), copying.table.req_to_token[:7]) and not static[7].any()


def test_debug_mode_checks_an_unread_page_table_as_the_batch_has_it(npu):
    served = Served(npu, context=1024)
    served.runner.debug = True
    served.runner(served.batch(0))
    batch = served.batch(1)
    assert torch.equal(served.runner(batch).cpu(), served.eager(batch).cpu())
    good = served.batch(2)
    table = good.req_to_token.clone()
    table[0, 0] = -1
    bad = dataclasses.replace(good, req_to_token=table)  # host metadata bound to it: only the check can tell
    with pytest.raises(ValueError, match=r"page-table entry \[0, 0\] is -1"):
        served.runner(bad)
