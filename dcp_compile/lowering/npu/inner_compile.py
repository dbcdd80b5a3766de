"""The torchair inner compiler: hands the rewritten graph to torchair, which captures it as an
Ascend NPU graph (aclgraph) and refreshes FIA's host lengths before each replay (docs/ascend.md §9.4).

torchair ships inside torch_npu (`import torchair` works once torch_npu is installed, docs/ascend.md §9.1).
Modes: 'reduce-overhead' (aclgraph through `torchair.get_npu_backend`) or 'npugraph_ex' (the
backend torch_npu >= 2.14 registers under that name, which 2.14 recommends over
reduce-overhead). FIA's `actual_seq_lengths_kv` entries reach it as symbolic graph inputs
(lowering/paged.HostPlaceholders makes them SymInts), so torchair updates them instead of baking them in.

`torchair_missing` is the one check that it can run here: NPULowering.unsupported_reasons gives
it when a model is applied (and the demo's parent, before any rank starts), so a missing torchair
is refused up front, not at the first step's compile.

torchair's graphs are its own NPU graphs: called inside another capture (the runtime's GraphRunner
with NPUGraphs, a front end's capture_decode_graphs) they would be captured twice, a nested
capture, so `outside_device_graphs` refuses that call. vllm-ascend, which captures with its own
graph wrapper, runs torchair / npugraph_ex eagerly under it (docs/ascend.md §9.1).
"""

from __future__ import annotations

import torch

from dcp_compile.lowering.npu.options import TORCHAIR_MODES
from dcp_compile.runtime.devices import capturing, emulated_npu, require_torch_npu, torch_npu_installed
from dcp_compile.runtime.failure import agreed

USE_EAGER = "use inner_compile='eager' (--inner-compile eager), which runs the same graph without an NPU graph"


def torchair_missing(mode: str = "reduce-overhead") -> str | None:
    """Why inner_compile='torchair' in `mode` cannot run here, naming what is missing and what to
    do; None where it can."""
    if not torch_npu_installed():
        where = " (the emulated npu device has no torchair)" if emulated_npu() else ""
        return (f"inner_compile='torchair' needs torchair, which ships with torch_npu, and torch_npu is not "
                f"installed{where}: {USE_EAGER}, or install torch_npu on a machine with the Ascend CANN toolkit")
    require_torch_npu("inner_compile='torchair'")
    if mode == "npugraph_ex":
        if "npugraph_ex" not in torch._dynamo.list_backends():
            return ("torchair_mode='npugraph_ex' needs the npugraph_ex backend of torch_npu >= 2.14, which this torch_npu "
                    "does not register: use torchair_mode='reduce-overhead'")
        return None
    try:
        import torchair

        torchair.get_npu_backend  # noqa: B018 - torch_npu installs torchair lazily: its first attribute imports it
    except Exception as exc:  # noqa: BLE001 - an ImportError, or what torch_npu's lazy torchair raises for it
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (f"inner_compile='torchair' needs torchair, which ships with torch_npu, and it does not import here "
                f"({reason}): reinstall torch_npu, or {USE_EAGER}")
    return None


def torchair_compiler(mode: str = "reduce-overhead"):
    """A `(gm, example_inputs) -> callable` compiler for the graph after the DCP passes."""
    if mode not in TORCHAIR_MODES:
        raise ValueError(f"torchair mode must be one of {TORCHAIR_MODES}, got {mode!r}")
    missing = torchair_missing(mode)
    if missing is not None:
        raise RuntimeError(missing)
    if mode == "npugraph_ex":
        return torch._dynamo.lookup_backend("npugraph_ex")
    import torchair

    config = torchair.CompilerConfig()
    config.mode = "reduce-overhead"
    return torchair.get_npu_backend(compiler_config=config)


NESTED_CAPTURE = ("inner_compile='torchair' captures its own NPU graph (torchair's aclgraph), and this step runs inside "
                  "another NPU graph capture (a GraphRunner with NPUGraphs, or capture_decode_graphs): a nested capture. "
                  "Replay the runtime's NPU graphs over a model applied with inner_compile='eager', or call the torchair "
                  "model directly (torchair replays its graphs itself)")


def outside_device_graphs(compiler):
    """`compiler` (a `(gm, example_inputs) -> callable` that captures NPU graphs itself) whose
    compiled graphs raise NESTED_CAPTURE when called while the current stream captures: before
    the graph runs, on every rank alike (the config decides it), so the error is agreed and the
    model keeps serving its eager calls (runtime/failure.py)."""

    def compile_graph(gm, example_inputs):
        compiled = compiler(gm, example_inputs)

        def run(*args):
            if capturing(torch.device("npu")):
                raise agreed(RuntimeError(NESTED_CAPTURE))
            return compiled(*args)

        return run

    return compile_graph
