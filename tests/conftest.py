"""Without a GPU, Triton kernels run under the interpreter. The variable must be set before
anything (dynamo, inductor, a test module) imports triton, so it is set here, first.

`npu_emulator`: the emulated `npu` device (dcp_compile/testing/npu_emulator) for the tests of
the NPU path. It sets DCP_COMPILE_NPU_EMULATOR=1 for the rest of the session (ranks spawned by a
test inherit it, and install the device themselves) and installs the device in this process
(torch_npu's device instead, where torch_npu is installed)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def npu_emulator():
    from dcp_compile.runtime import devices

    previous = os.environ.get(devices.EMULATOR_ENV)
    os.environ[devices.EMULATOR_ENV] = "1"
    devices.require_torch_npu("the tests of the NPU path")
    yield torch.device("npu", 0)
    if previous is None:
        os.environ.pop(devices.EMULATOR_ENV)
    else:
        os.environ[devices.EMULATOR_ENV] = previous
