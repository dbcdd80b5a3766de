"""The torchair inner compiler: hands the rewritten graph to torchair, which captures it as an
Ascend NPU graph (aclgraph) and refreshes FIA's host lengths before each replay (docs/ascend.md §9.4).

torchair ships inside torch_npu (`import torchair` works once torch_npu is installed, docs/ascend.md §9.1).
Modes: 'reduce-overhead' (aclgraph through `torchair.get_npu_backend`) or 'npugraph_ex' (the
backend torch_npu >= 2.14 registers under that name, which 2.14 recommends over
reduce-overhead). FIA's `actual_seq_lengths_kv` entries reach it as symbolic graph inputs
(lowering/paged.HostPlaceholders makes them SymInts), so torchair updates them instead of baking them in.
"""

from __future__ import annotations

import torch

from dcp_compile.lowering.npu.options import TORCHAIR_MODES
from dcp_compile.runtime.devices import require_torch_npu



def torchair_compiler(mode: str = "reduce-overhead"):
    """A `(gm, example_inputs) -> callable` compiler for the graph after the DCP passes."""
    if mode not in TORCHAIR_MODES:
        raise ValueError(f"torchair mode must be one of {TORCHAIR_MODES}, got {mode!r}")
    require_torch_npu("inner_compile='torchair'")
    if mode == "npugraph_ex":
        if "npugraph_ex" not in torch._dynamo.list_backends():
            raise RuntimeError("the npugraph_ex backend needs torch_npu >= 2.14; use torchair mode 'reduce-overhead'")
        return torch._dynamo.lookup_backend("npugraph_ex")
    import torchair

    config = torchair.CompilerConfig()
    config.mode = "reduce-overhead"
    return torchair.get_npu_backend(compiler_config=config)
