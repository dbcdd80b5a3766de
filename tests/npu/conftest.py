"""Every test here runs on the emulated npu device (the `npu_emulator` fixture of tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _emulated_npu(npu_emulator):
    return npu_emulator
