"""versions.py: the deployment matrix's refusals, per rule, on parametrised deployments (pure Python,
no device), and deployment() read through the emulator's environment variables."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from dcp_compile.lowering.npu import versions
from dcp_compile.lowering.npu.options import NPUOptions
from dcp_compile.lowering.npu.versions import Deployment


def opts(**kw):
    base = dict(npu_kernels="native", npu_kv_format="nd", fia_version=1, npu_verify="split", fia_block_sizes="cann-2025")
    base.update(kw)
    return types.SimpleNamespace(**base)


# What the engines' images run (docs/ascend.md §18.5), one per family.
A2 = Deployment("Ascend910B3", "A2", "9.0.0", "2.10.0", "3.2.1")
A3 = Deployment("Ascend910_9391", "A3", "8.5.0", "2.9.0.post2", "3.2.0")
A5 = Deployment("Ascend950PR", "A5", "9.1.0", "2.10.0.post4", None)


@pytest.mark.parametrize("dep", [A2, A3, A5], ids=["A2", "A3", "A5"])
def test_default_options_accepted(dep):
    assert versions.unsupported_reasons(NPUOptions(), dep) == []
    assert versions.unsupported_reasons(object(), dep) == []  # every attribute missing: the defaults


# torch_npu's SoC table (versions.py names its source): each name by family. "Ascend910B" (SocVersion
# 104) is a first-generation Ascend 910, not an Atlas A2.
A2_NAMES = ["Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1"]
A3_NAMES = ["Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "Ascend910_9382", "Ascend910_9372", "Ascend910_9362",
            "Ascend910_9363", "Ascend910_9361"]
A5_NAMES = ["Ascend950PR_9579", "Ascend950PR_957b", "Ascend950DT_9591", "Ascend950DT_95A1", "Ascend950PR", "Ascend950DT"]
REFUSED_NAMES = ["Ascend910B", "Ascend910A", "Ascend910ProA", "Ascend910ProB", "Ascend910PremiumA", "Ascend310P3",
                 "Ascend310B1", "Ascend910B5", "Ascend910B3 ", "ascend910b3", "Ascend910B41", "Ascend910_93",
                 "Ascend910_9391x", "", None]


@pytest.mark.parametrize("soc,family", [*((n, "A2") for n in A2_NAMES), *((n, "A3") for n in A3_NAMES),
                                        *((n, "A5") for n in A5_NAMES), *((n, None) for n in REFUSED_NAMES)])
def test_soc_family(soc, family):
    assert versions.soc_family(soc) == family


def test_a_first_generation_ascend910b_is_refused():
    (reason,) = versions.unsupported_reasons(opts(), Deployment("Ascend910B", versions.soc_family("Ascend910B"),
                                                                "9.0.0", "2.10.0", None))
    assert "Ascend910B (no known family)" in reason and "Ascend910B1" in reason and "§18.1" in reason


def test_unknown_soc_refused():
    (reason,) = versions.unsupported_reasons(opts(), Deployment("Ascend310P3", None, "9.0.0", "2.10.0", None))
    assert "Ascend310P3" in reason and "§18.1" in reason


@pytest.mark.parametrize("cann", ["8.3.RC1", "8.2.RC1", "8.0.0", "8.5.0.alpha001"])
def test_old_cann_refused_for_every_option_set(cann):
    (reason,) = versions.unsupported_reasons(opts(), A2._replace(cann=cann))
    assert f"CANN {cann}" in reason and ">= 8.5.0" in reason and "§2.4" in reason


@pytest.mark.parametrize("cann", [None, "", "garbage"])
def test_unreadable_cann_refused(cann):
    (reason,) = versions.unsupported_reasons(opts(), A2._replace(cann=cann))
    assert "could not be read" in reason


@pytest.mark.parametrize("torch_npu", ["2.7.1", "2.7.1.post2", "2.8.0.post2", "2.9.0", "2.6.0.post5", "2.5.1.post1"])
def test_native_refused_without_scatter_cache_mode(torch_npu):
    (reason,) = versions.unsupported_reasons(opts(npu_kernels="native"), A2._replace(torch_npu=torch_npu))
    assert "npu_kernels='native'" in reason and f"torch_npu {torch_npu}" in reason and "§18.2" in reason


@pytest.mark.parametrize("torch_npu", ["2.7.1.post4", "2.7.1.post8", "2.8.0.post4", "2.9.0.post2", "2.9.1", "2.10.0",
                                       "2.10.0.post6", "2.11.0", "2.12.0", "2.13.0", "2.14.0"])
def test_native_accepted_with_scatter_cache_mode(torch_npu):
    assert versions.unsupported_reasons(opts(npu_kernels="native"), A2._replace(torch_npu=torch_npu)) == []


@pytest.mark.parametrize("dep", [A2, A3], ids=["A2", "A3"])
def test_triton_accepted_on_a2_a3(dep):
    assert versions.unsupported_reasons(opts(npu_kernels="triton"), dep) == []


def test_triton_refused_on_a5():
    reasons = versions.unsupported_reasons(opts(npu_kernels="triton"), A5._replace(triton_ascend="3.2.1"))
    (reason,) = reasons
    assert "npu_kernels='triton'" in reason and "Ascend950PR" in reason and "A2/A3" in reason


def test_triton_refused_without_triton_ascend():
    (reason,) = versions.unsupported_reasons(opts(npu_kernels="triton"), A2._replace(triton_ascend=None))
    assert "triton-ascend absent" in reason and ">= 3.2.0" in reason


@pytest.mark.parametrize("triton", ["3.2.0rc4", "3.1.0"])
def test_triton_refused_before_3_2_0(triton):
    (reason,) = versions.unsupported_reasons(opts(npu_kernels="triton"), A2._replace(triton_ascend=triton))
    assert f"triton-ascend {triton}" in reason


def test_triton_3_2_1_needs_cann_9():
    (reason,) = versions.unsupported_reasons(opts(npu_kernels="triton"), A3._replace(triton_ascend="3.2.1"))
    assert "CANN >= 9.0.0" in reason and "CANN 8.5.0" in reason
    assert versions.unsupported_reasons(opts(npu_kernels="triton"), A3._replace(triton_ascend="3.2.0")) == []


@pytest.mark.parametrize("torch_npu", ["2.6.0", "2.5.1.post1", "2.4.0.post4"])
def test_fia_v2_refused_before_2_6_0_post3(torch_npu):
    reasons = versions.unsupported_reasons(opts(fia_version=2, npu_kernels="triton"),
                                           A2._replace(torch_npu=torch_npu))
    (reason,) = reasons
    assert "fia_version=2" in reason and f"torch_npu {torch_npu}" in reason and "§15.2" in reason


@pytest.mark.parametrize("torch_npu", ["2.6.0.post3", "2.7.1", "2.8.0"])
def test_fia_v2_accepted_from_2_6_0_post3(torch_npu):
    assert versions.unsupported_reasons(opts(fia_version=2, npu_kernels="triton"),
                                        A2._replace(torch_npu=torch_npu)) == []


def test_mask_refused_on_cann_8_5():
    (reason,) = versions.unsupported_reasons(opts(npu_verify="mask"), A3)
    assert "npu_verify='mask'" in reason and "c29bc106" in reason and "CANN 8.5.0" in reason and "§6.4" in reason


@pytest.mark.parametrize("dep", [A2, A5], ids=["A2", "A5"])
def test_mask_accepted_on_cann_9(dep):
    assert versions.unsupported_reasons(opts(npu_verify="mask"), dep) == []


def test_mask_on_a5_is_advised_against():
    assert any("npu_verify='mask'" in note for note in versions.advisories(opts(npu_verify="mask"), A5))
    assert not any("npu_verify" in note for note in versions.advisories(opts(npu_verify="mask"), A2))


def test_block_sizes_2026_refused_on_cann_8_5():
    (reason,) = versions.unsupported_reasons(opts(fia_block_sizes="cann-2026"), A3)
    assert "fia_block_sizes='cann-2026'" in reason and "§4.5" in reason
    assert versions.unsupported_reasons(opts(fia_block_sizes="cann-2026"), A2) == []


@pytest.mark.parametrize("dep", [A2, A3, A5], ids=["A2", "A3", "A5"])
def test_nz_accepted(dep):
    assert versions.unsupported_reasons(opts(npu_kv_format="nz"), dep) == []


def test_nz_with_the_native_write_refused_on_an_a5_cann_before_pa_nz():
    """The Ascend950 (arch35) kernels of npu_scatter_pa_kv_cache wrote ND 'Norm' only before 2026
    ops-transformer: an NZ cache written natively there is refused; ND, and the Triton writer's own
    NZ addressing, are not."""
    early_a5 = A5._replace(cann="8.5.0")
    (reason,) = versions.unsupported_reasons(opts(npu_kv_format="nz"), early_a5)
    assert "npu_kv_format='nz'" in reason and "PA_NZ" in reason and "npu_kv_format='nd'" in reason
    assert versions.unsupported_reasons(opts(), early_a5) == []
    assert versions.unsupported_reasons(opts(npu_kv_format="nz"), A2._replace(cann="8.5.0")) == []


def test_several_rules_give_several_reasons():
    dep = Deployment("Ascend950PR", "A5", "8.3.RC1", "2.6.0", "3.2.0")
    reasons = versions.unsupported_reasons(opts(npu_kernels="triton", fia_version=2, npu_verify="mask"), dep)
    assert len(reasons) == 4, reasons  # CANN < 8.5, triton on A5, v2 on 2.6.0, mask on 8.3
    assert all(r.endswith(")") for r in reasons)


def test_emulated_deployment_skips_package_rules():
    dep = Deployment("Ascend910B3", "A2", "8.5.0", None, None)
    assert versions.unsupported_reasons(opts(npu_kernels="triton", fia_version=2), dep) == []


def test_deployment_from_emulator_env(monkeypatch):
    import torch
    # torch.npu without get_device_name / utils.get_cann_version (torch_npu absent; the emulator may be)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(), raising=False)
    monkeypatch.setenv("DCP_COMPILE_NPU_EMULATOR", "1")
    monkeypatch.setenv("DCP_COMPILE_NPU_EMULATOR_SOC", "Ascend950PR")
    monkeypatch.setenv("DCP_COMPILE_NPU_EMULATOR_CANN", "8.3.RC1")
    dep = versions.deployment()
    assert (dep.soc, dep.family, dep.cann) == ("Ascend950PR", "A5", "8.3.RC1")
    assert any("8.3.RC1" in r for r in versions.unsupported_reasons(opts(), dep))
    monkeypatch.delenv("DCP_COMPILE_NPU_EMULATOR_SOC")
    monkeypatch.delenv("DCP_COMPILE_NPU_EMULATOR_CANN")
    dep = versions.deployment()
    assert (dep.soc, dep.family, dep.cann) == ("Ascend910B3", "A2", "9.0.0")
    if dep.torch_npu is None:
        assert versions.unsupported_reasons(NPUOptions(), dep) == []
    monkeypatch.delenv("DCP_COMPILE_NPU_EMULATOR")
    assert versions.deployment()[:3] == (None, None, None)


def test_deployment_reads_torch_npu_functions(monkeypatch):
    import torch
    fake = types.SimpleNamespace(get_device_name=lambda: "Ascend910_9391",
                                 utils=types.SimpleNamespace(get_cann_version=lambda module="CANN": "9.0.0"))
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    monkeypatch.setenv("DCP_COMPILE_NPU_EMULATOR", "1")
    monkeypatch.setenv("DCP_COMPILE_NPU_EMULATOR_SOC", "Ascend950PR")
    assert versions.deployment()[:3] == ("Ascend910_9391", "A3", "9.0.0")  # the functions win over the env


def test_version_ordering():
    p = versions.parse_cann
    assert p("8.3.RC1") < p("8.3.0") < p("8.5.0.alpha001") < p("8.5.0") < p("9.0.0") < p("9.1.0")
    assert p("8.0.RC3.alpha001") < p("8.0.RC3") and p("9.0.T5") < p("9.0.RC1")
    r = versions.parse_release
    assert r("2.7.1") < r("2.7.1.post4") < r("2.7.1.post8") < r("2.8.0") < r("2.10.0") < r("2.10.0.post4")
    assert r("3.2.0rc4") < r("3.2.0") < r("3.2.1") and r("2.13.0+cpu") == r("2.13.0")


def test_matrix_rows_have_sources():
    for row in versions.MATRIX:
        assert row.source.strip(), row
    options = {r.option for r in versions.MATRIX}
    assert {"npu_kernels", "npu_kv_format", "fia_version", "npu_verify", "fia_block_sizes"} <= options


def test_readme_prints_the_stacks_and_what_each_refuses():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert versions.stacks_markdown() in readme, "README 'Ascend versions': paste versions.stacks_markdown()"
    sglang_a3 = versions.refused_on(versions.STACKS[0])  # CANN 8.5.0: the 2025 kernels
    assert "npu_verify='mask'" in sglang_a3 and "npu_kernels='native'" not in sglang_a3


def test_readme_prints_the_matrix():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert versions.matrix_markdown() in readme, "README 'Ascend versions': paste versions.matrix_markdown()"


def test_doc_sections_cited_exist():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "ascend.md").read_text()
    cited = set(re.findall(r"§(\d+(?:\.\d+)?)", Path(versions.__file__).read_text()))
    for section in cited:
        assert re.search(rf"^#+ §{re.escape(section)}\b", doc, re.M), f"docs/ascend.md lacks §{section}"
