"""What the vendor's meta functions import from torch_npu, without torch_npu (snapshot.py SHIMMED).

A snapshot's `meta.py` is torch_npu's own `op_plugin/meta/_meta_registrations.py`, cut to the ops
the NPU lowering calls; its imports of torch_npu internals come from here instead:

- `impl(m, name)`: the vendor's decorator registers a Meta kernel on the `npu` library; this one
  only collects the function under the op's name (`FUNCTIONS`), since the stand-ins register
  their own fake kernels and a release's meta function is called by the emulator's check;
- `ErrCode`, `ops_error`: the suffix torch_npu appends to an error message
  (torch_npu/utils/_error_code.py: "ERR<submodule><code> <submodule> <message>"), without the
  time, pid and device it also prints;
- `torch_npu`: the module attributes the meta functions read: the custom dtype enums the meta
  file itself lists in TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP (hifloat8 290, float4_e2m1fn_x2
  296, float4_e1m2fn_x2 297);
- `get_cann_version`, `get_soc_version`: the emulated device's (torch.npu.utils).
"""

from __future__ import annotations

import threading
import types
from enum import Enum

_collecting = threading.local()


class ErrCode(Enum):
    PARAM = (1, "invalid parameter")
    TYPE = (2, "invalid type")
    VALUE = (3, "invalid value")
    NOT_SUPPORT = (7, "feature not supported")

    @property
    def code(self) -> int:
        return self.value[0]

    @property
    def msg(self) -> str:
        return self.value[1]


_OPS_SUBMODULE = 1


def ops_error(error: ErrCode) -> str:
    return f"\n[ERROR] ERR{_OPS_SUBMODULE:0>2d}{error.code:0>3d} OPS {error.msg}"


m = object()
"""Stands for the vendor's `Library("npu", "IMPL", "Meta")`: nothing is registered."""


def collecting(functions: dict):
    """Make `impl` put the functions of the module being loaded into `functions`."""
    _collecting.functions = functions


def impl(library, name: str):
    def collect(function):
        _collecting.functions[name] = function
        return function

    return collect


torch_npu = types.SimpleNamespace(hifloat8=290, float4_e2m1fn_x2=296, float4_e1m2fn_x2=297)


def get_cann_version() -> str:
    import torch

    return torch.npu.utils.get_cann_version()


def get_soc_version() -> int:
    import torch

    return torch.npu.get_soc_version()
