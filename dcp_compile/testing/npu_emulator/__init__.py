"""An emulated Ascend NPU for machines without one (CI, this project's CPU machines).

`DCP_COMPILE_NPU_EMULATOR=1` makes `dcp_compile.runtime.devices.require_torch_npu` install this
instead of importing torch_npu; nothing else in the project knows the device is emulated.
`install()` gives:

- a device of type `npu`: PyTorch's PrivateUse1 key, renamed, from a small C++ extension
  (device.cpp) built once per virtualenv: an allocator of host memory, a device guard, copies
  to and from the host, pinned host memory; aten ops run their CPU kernels on the same bytes,
  and an op of another namespace without an npu kernel fails as on a device without one;
- `torch.npu` (module.py): devices, streams, events, synchronize, the SoC and CANN version
  (`$DCP_COMPILE_NPU_EMULATOR_SOC`, default Ascend910B3; `$DCP_COMPILE_NPU_EMULATOR_CANN`, default
  9.0.0), and NPU graphs (graphs.py): capture records the device work and runs none of it, replay
  runs exactly that with the host values of the capture; with `auto_dispatch_capture`, FIA is
  captured as the selected torch_npu release's handler captures it, and `update(cpu_update_input=...)`
  rewrites its host lengths by argument name by that release's rules, on torch_npu's shared
  update stream (`graph.graph_dispatch_mode.update_stream`). As on hardware: host traffic in a capture
  (a pageable upload, any device-to-host read, an op that runs on the host or synchronises to learn
  its output's shape) is an error; an FIA call captured with a KV length of 0 is refused; a replay
  whose FIA calls were not updated since the last replay raises (hardware would hang); an update
  not ordered after the graph's last replay (by a host wait, or the update stream waiting on an
  event recorded after it) raises (hardware would race);
- host syncs (`host_syncs()`): blocking device-to-host reads and scalar reads, uploads torch_npu
  synchronises (all but non-blocking ones from pinned memory), host waits (synchronize on the
  device, a stream, an event), aten ops torch_npu runs on the host (op_coverage.py,
  `ops_off_device()`) and ops whose kernel synchronises the stream for a data-dependent output
  shape (`syncing_ops()`); every upload's bytes (`h2d_bytes()`); all reset by `reset_host_syncs()`.
  Nothing counts during a graph replay;
- the torch_npu release it stands in for (releases/, `$DCP_COMPILE_NPU_EMULATOR_TORCH_NPU`,
  default 2.13.0): snapshots of each release's wheel, made by `python -m
  dcp_compile.testing.npu_emulator.snapshot` without importing torch_npu, give the stand-ins'
  schemas, the meta functions every stand-in call is checked against, and the NPU-graph update
  rules (docs/ascend.md §21);
- an `hccl` process-group backend (hccl.py) that runs collectives through gloo on the host
  views of npu tensors, functional collectives and collectives inside graphs included; it counts
  all-to-all calls with explicit split lists (HCCL's AlltoAllV path: `alltoallv_calls()`).

What it does not model: speed, CANN's kernel numerics (the stand-ins of lowering/npu compute in
fp32 on the host), HCCL on real links, concurrency between streams (work runs when issued, so a
replay cannot be issued before its update as torchair does), and torch_npu's own H2D staging
(bytes are counted, not timed). Facts and sources: docs/ascend.md §16, §17, §21.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch

ENV = "DCP_COMPILE_NPU_EMULATOR"
DEVICE_COUNT = 8
_SOURCE = Path(__file__).with_name("device.cpp")
_installed = threading.Lock()
_done = False


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def build_directory() -> Path:
    """Where the extension is built and cached: inside the virtualenv (one build per env)."""
    return Path(os.environ.get("DCP_COMPILE_NPU_EMULATOR_BUILD", Path(sys.prefix) / "dcp_compile_npu_emulator"))


def _load_extension() -> None:
    from torch.utils import cpp_extension

    folder = build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name="dcp_npu_emulator", sources=[str(_SOURCE)], build_directory=str(folder),
                       is_python_module=False, extra_cflags=["-O1"], verbose=False)


def host_syncs() -> int:
    """Host syncs since the last reset_host_syncs(): blocking device-to-host reads (`.item()`,
    `.tolist()`, `.cpu()`), host-to-device copies torch_npu synchronises (all but non-blocking
    ones from pinned memory), host waits (`torch.npu.synchronize()`, `Stream.synchronize()`,
    `Event.synchronize()`), calls of aten ops torch_npu runs on the host (ops_off_device()) and
    of ops whose kernel synchronises to learn its output's shape (syncing_ops())."""
    return int(torch.ops.dcp_npu_emulator.host_syncs())


def h2d_bytes() -> int:
    """Bytes copied from the host to the device since the last reset_host_syncs(), pinned or not
    (graph replays' recorded copies included): each copy's elements in the source's dtype."""
    return int(torch.ops.dcp_npu_emulator.h2d_bytes())


def syncing_ops() -> dict[str, int]:
    """Calls of aten ops whose NPU kernel synchronises the stream to learn its output's size
    (op_coverage.SYNCS: nonzero, masked_select, bool-mask index, unique, repeat_interleave
    without output_size) since the last reset_host_syncs(), by op."""
    names, calls = torch.ops.dcp_npu_emulator.syncing_ops()
    return dict(zip(names, calls))


def alltoallv_calls() -> int:
    """hccl all_to_all_single calls with explicit split lists (HCCL's AlltoAllV path) since the
    last reset_host_syncs(); calls with empty lists (AlltoAll) are not counted."""
    from dcp_compile.testing.npu_emulator import hccl

    return hccl.alltoallv_calls()


def ops_off_device() -> dict[str, int]:
    """Calls of aten ops torch_npu runs on the host since the last reset_host_syncs(), by op."""
    names, calls = torch.ops.dcp_npu_emulator.ops_off_device()
    return dict(zip(names, calls))


def reset_host_syncs() -> None:
    """Zero host_syncs(), h2d_bytes(), ops_off_device(), syncing_ops() and alltoallv_calls()."""
    from dcp_compile.testing.npu_emulator import hccl

    torch.ops.dcp_npu_emulator.reset_host_syncs()
    hccl.reset_alltoallv_calls()


def install(device_count: int = DEVICE_COUNT) -> None:
    """Make the emulated `npu` device, `torch.npu` and the `hccl` backend available (idempotent)."""
    global _done
    with _installed:
        if _done:
            return
        import importlib.util

        if importlib.util.find_spec("torch_npu") is not None:
            raise RuntimeError("torch_npu is installed: the NPU emulator stands in for it only where it is absent")
        _load_extension()
        torch.ops.dcp_npu_emulator.set_device_count(device_count)
        from dcp_compile.testing.npu_emulator import npu_aten_ops, op_coverage

        # The acl_op-only ops too: torch_npu's kernel replaces torch's composite (lstm_cell's), so a
        # capture meets the op whole, and refuses it, rather than recording its parts.
        torch.ops.dcp_npu_emulator.register_device_kernels(sorted(op_coverage.FALLBACKS) + list(op_coverage.OWN_KERNELS)
                                                           + sorted(npu_aten_ops.ACL_OP_ONLY))
        torch.utils.rename_privateuse1_backend("npu")
        from dcp_compile.testing.npu_emulator import hccl, module

        module.DEVICE_COUNT = device_count
        torch._register_device_module("npu", module)
        torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
        hccl.register()
        _done = True
