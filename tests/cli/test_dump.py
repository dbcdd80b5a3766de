"""`dcp-compile dump` and DCP_COMPILE_DUMP: the files, the op-count diff, the HTML page, SVG,
and a clear error for each kind of bad input."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import dcp_compile
from dcp_compile.cli.main import main
from dcp_compile.debug import dump as text_dump
from dcp_compile.debug import svg
from dcp_compile.debug.dump import OP_DIFF_TXT, REPORT_JSON, snapshot_name
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.passes.manager import PASS_NAMES
from dcp_compile.runtime.batch import RequestTable

MLA_LAYERS = 3  # tiny: mla, linear, mla, mla


def dump(tmp: Path, *options: str) -> tuple[int, Path]:
    out = tmp / "out"
    return main(["dump", "--out", str(out), *options]), out


@pytest.fixture(scope="module")
def tiny_html(tmp_path_factory):
    """One full dump of the tiny model at DCP 2 (TP 2), shared by the tests that read it."""
    tmp = tmp_path_factory.mktemp("tiny")
    code, out = dump(tmp, "--model", "tiny", "--dcp-size", "2", "--format", "html")
    assert code == 0
    return out


def test_writes_graphs_before_and_after_every_pass(tiny_html):
    folder = tiny_html / "graph00"
    for order, name in enumerate(PASS_NAMES):
        for when in ("before", "after"):
            text = (folder / snapshot_name(order, name, when)).read_text()
            assert text.startswith("class GraphModule")
    after = (folder / snapshot_name(PASS_NAMES.index("gather_q_attention"), "gather_q_attention", "after")).read_text()
    # Shapes and dtypes, the fake group names, and tuple-valued nodes annotated too.
    assert 'L_input_ids_: "i64[4]"' in after
    assert "'fake-dcp-group'" in after and "'fake-tp-group'" in after
    assert "mla_partial_attention.default(" in after and "# -> (bf16[4, 8, 32], f32[4, 8])" in after


def test_op_count_diff(tiny_html):
    report = json.loads((tiny_html / "graph00" / REPORT_JSON).read_text())
    by_name = {p["name"]: p for p in report["passes"]}
    rewrite = by_name["gather_q_attention"]
    assert rewrite["ran"] and rewrite["sites"] == MLA_LAYERS
    assert rewrite["op_diff"]["dcp::mla_attention"] == {"before": MLA_LAYERS, "after": 0}
    assert rewrite["op_diff"]["dcp::mla_partial_attention"] == {"before": 0, "after": MLA_LAYERS}
    assert rewrite["op_diff"]["_c10d_functional::all_to_all_single"] == {"before": 0, "after": MLA_LAYERS}
    assert by_name["shard_kv_write"]["op_diff"] == {
        "dcp::mla_kv_write": {"before": MLA_LAYERS, "after": 0},
        "dcp::sharded_kv_write": {"before": 0, "after": MLA_LAYERS},
    }
    assert rewrite["nodes_after"] > rewrite["nodes_before"]
    text = (tiny_html / "graph00" / OP_DIFF_TXT).read_text()
    assert "dcp::mla_attention" in text and f"{MLA_LAYERS} -> 0" in text
    summary = json.loads((tiny_html / "dump.json").read_text())
    assert summary["mla_sites"] == summary["mla_sites_rewritten"] == MLA_LAYERS
    assert summary["tp_size"] == 2 and summary["command"].startswith("dcp-compile dump --model tiny")


def test_html_is_self_contained_and_shows_every_pass(tiny_html):
    page = (tiny_html / "index.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for name in PASS_NAMES:
        assert f"<code>{name}</code>" in page, name
    order = PASS_NAMES.index("gather_q_attention")
    assert f'id="pass-{order:02d}-change"' in page  # its first change, linked from the page
    assert "<script" not in page and "<link" not in page and "http://" not in page and "https://" not in page


def test_summary_table_printed(tmp_path, capsys):
    code, out = dump(tmp_path, "--model", "tiny", "--layers", "1", "--dcp-size", "2", "--only", "gather_q_attention")
    assert code == 0
    printed = capsys.readouterr().out
    for name in PASS_NAMES:
        assert name in printed
    assert "MLA sites rewritten: 1 of 1" in printed and "dcp::mla_attention 1 -> 0" in printed
    # --only: that pass's graphs alone, the report still covers every pass.
    order = PASS_NAMES.index("gather_q_attention")
    assert sorted(p.name for p in (out / "graph00").glob("*.py")) == [
        snapshot_name(order, "gather_q_attention", "after"), snapshot_name(order, "gather_q_attention", "before")]
    assert len(json.loads((out / "graph00" / REPORT_JSON).read_text())["passes"]) == len(PASS_NAMES)


def test_verbose_logs_through_the_dcp_compile_loggers(tmp_path, caplog):
    with caplog.at_level("INFO", logger="dcp_compile"):
        assert main(["-v", "dump", "--model", "tiny", "--layers", "1", "--out", str(tmp_path)]) == 0
    names = {record.name for record in caplog.records}
    assert {"dcp_compile.cli.dump", "dcp_compile.passes", "dcp_compile.debug"} <= names


def test_disable_leaves_attention_unrewritten(tmp_path, capsys):
    code, out = dump(tmp_path, "--model", "tiny", "--layers", "1", "--disable", "gather_q_attention")
    assert code == 0
    report = {p["name"]: p for p in json.loads((out / "graph00" / REPORT_JSON).read_text())["passes"]}
    assert not report["gather_q_attention"]["ran"] and report["shard_kv_write"]["sites"] == 1
    assert report["verify"]["ops_after"]["dcp::mla_attention"] == 1
    assert "MLA sites rewritten: 0 of 1" in capsys.readouterr().out


def test_gather_kv_strategy(tmp_path):
    code, out = dump(tmp_path, "--model", "tiny", "--mode", "extend", "--chunk", "8", "--attention-strategy", "gather-kv")
    assert code == 0
    report = {p["name"]: p for p in json.loads((out / "graph00" / REPORT_JSON).read_text())["passes"]}
    assert not report["gather_q_attention"]["ran"] and report["gather_kv_attention"]["sites"] == MLA_LAYERS
    assert report["gather_kv_attention"]["op_diff"]["dcp::mla_attention"] == {"before": MLA_LAYERS, "after": 0}
    assert json.loads((out / "dump.json").read_text())["mla_sites_rewritten"] == MLA_LAYERS


@pytest.mark.parametrize("options, strategy, rewrite_pass", [
    (["--mode", "extend", "--chunk", "200", "--context", "10"], "gather-kv", "gather_kv_attention"),
    (["--mode", "decode", "--context", "4000"], "gather-q", "gather_q_attention"),
])
def test_auto_strategy_is_chosen_by_the_cost_model_and_explained(tmp_path, capsys, options, strategy, rewrite_pass):
    code, out = dump(tmp_path, "--model", "tiny", "--dcp-size", "2", *options)
    assert code == 0
    decision = json.loads((out / "dump.json").read_text())["attention_strategy"]
    assert decision["strategy"] == strategy and not decision["forced"]
    other = next(name for name in decision["costs"] if name != strategy)
    assert decision["costs"][strategy]["seconds"] <= decision["costs"][other]["seconds"]
    report = {p["name"]: p for p in json.loads((out / "graph00" / REPORT_JSON).read_text())["passes"]}
    assert report[rewrite_pass]["sites"] == MLA_LAYERS
    assert f"attention strategy (cost model): {strategy}" in capsys.readouterr().out


@pytest.mark.parametrize("mode, options, tokens", [
    ("verify", ["--batch", "2", "--draft-len", "3"], 6),
    ("extend", ["--batch", "2", "--chunk", "5", "--context", "7"], 10),
    ("extend", ["--batch", "2", "--chunk", "3", "--interleave", "4", "--debug-checks"], 6),
])
def test_modes_shape_the_batch(tmp_path, mode, options, tokens):
    code, out = dump(tmp_path, "--model", "tiny", "--layers", "1", "--mode", mode, *options)
    assert code == 0
    before = (out / "graph00" / snapshot_name(0, PASS_NAMES[0], "before")).read_text()
    assert f'L_input_ids_: "i64[{tokens}]"' in before and f'L_positions_: "i64[{tokens}]"' in before
    assert json.loads((out / "dump.json").read_text())["mla_sites_rewritten"] == 1


def test_the_npu_dump_shows_int32_slots_the_reserved_block_and_no_negative_slot(tmp_path):
    """The native KV write as `--kernels npu` dumps it (docs/ascend.md §17, §19): one int32 slot
    mapping feeds every layer's npu_scatter_pa_kv_cache, with no -1 anywhere in it (tokens a rank
    does not keep write the reserved row, the first past the locations' rows); each layer's parts
    hold the locations' rows and one reserved block, of which FIA reads the locations' rows only."""
    code, out = dump(tmp_path, "--model", "tiny-512", "--kernels", "npu", "--dcp-size", "2")
    assert code == 0
    (verified,) = (out / "graph00").glob("*-verify.after.py")
    lines = verified.read_text().splitlines()
    (slots,) = [line.strip() for line in lines if "dcp_npu.slot_mapping.default(" in line]
    writes = [line.strip() for line in lines if "dcp_npu.scatter_kv_cache.default(" in line]
    name, annotation = slots.split(": ", 1)
    assert annotation.startswith('"i32[')
    rows = int(slots.rsplit("(", 1)[1].split(", ")[1])  # slot_mapping(loc, rows, rank, size, interleave)
    assert len(writes) == MLA_LAYERS and all(f", {name}, " in write for write in writes)
    assert not any(re.search(r"[(\[, ]-1[,)\]]", line) for line in [slots, *writes])
    block = 128
    for layer in range(MLA_LAYERS):
        (part,) = [line.strip() for line in lines if line.strip().startswith(f"dcp_kv_latent_{layer}: ")]
        assert f'"bf16[{rows + block}, 512]"' in part
    assert sum(f"(dcp_kv_latent_0, 0, 0, {rows})" in line for line in lines) == 1  # FIA's view: the locations' rows


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")
def test_svg(tmp_path):
    code, out = dump(tmp_path, "--model", "tiny", "--layers", "1", "--format", "svg", "--only", "shard_kv_write")
    assert code == 0
    order = PASS_NAMES.index("shard_kv_write")
    for when, op in (("before", "mla_kv_write"), ("after", "sharded_kv_write")):
        image = (out / "graph00" / snapshot_name(order, "shard_kv_write", when, "svg")).read_text()
        assert "<svg" in image and f"dcp::{op}" in image


def test_svg_without_dot_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(svg.shutil, "which", lambda name: None)
    code, _ = dump(tmp_path, "--model", "tiny", "--format", "svg")
    assert code == 2
    assert "needs Graphviz's `dot` program on PATH" in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    (["--model", "llama"], "unknown model 'llama'; choose one of"),
    (["--mode", "prefill"], "unknown mode 'prefill'; choose one of ['decode', 'verify', 'extend']"),
    (["--format", "pdf"], "unknown format 'pdf'; choose one of ['text', 'html', 'svg']"),
    (["--attention-strategy", "ring"], "unknown attention strategy 'ring'; choose one of ['auto', 'gather-q', 'gather-kv']"),
    (["--disable", "no_such_pass"], "unknown pass name(s) ['no_such_pass']; passes are"),
    (["--only", "no_such_pass"], "unknown pass name 'no_such_pass' for --only; passes are"),
    (["--disable", "verify"], "cannot be disabled"),
    (["--dcp-size", "3", "--tp-size", "3"], "tp_size 3 does not split model tiny (8 attention heads"),
    (["--dcp-size", "4", "--tp-size", "2"], "dcp_size 4 must divide tp_size 2"),
    (["--model", "kimi-k2", "--dcp-size", "3", "--tp-size", "6"], "tp_size 6 does not split model kimi-k2 (64 attention heads"),
    (["--batch", "0"], "batch must be >= 1"),
    (["--interleave", "4", "--page-size", "6"], "interleave size 4 must divide the page size 6"),
    (["--layers", "0"], "layers must be an int >= 1, got 0"),
    (["--draft-len", "17", "--mode", "verify"], "draft-len must be in [1, 16] (verify's k), got 17"),
    (["--draft-len", "0"], "draft-len must be in [1, 16] (verify's k), got 0"),
    (["--context", "1000000000"], "context 1000000000 exceeds the dump's limit of 1048576 tokens"),
    (["--batch", "100000"], "batch 100000 exceeds the dump's limit of 1024 requests"),
    (["--mode", "extend", "--chunk", "2000000"], "chunk 2000000 exceeds the dump's limit of 1048576 tokens"),
    (["--page-size", "2097152"], "page-size 2097152 exceeds the dump's limit of 1048576 locations"),
    (["--kernels", "npu", "--block-size", "0"], "block-size must be >= 1, got 0"),
    (["--kernels", "npu", "--block-size", "1048576"], "block-size 1048576 makes pages of 2097152 locations, more than "
                                                      "the dump's limit of 1048576"),
    (["--layers", "1000"], "tiny with 1000 layers exceeds the dump's limit of 256 layers"),
    (["--batch", "1024", "--context", "131072", "--page-size", "64"],
     "1024 requests of 131073 tokens make 134218752 page-table entries, more than the dump's limit of 67108864"),
    (["--batch", "64", "--context", "131072"], "64 requests of 131073 tokens need 8388672 pages of 1, more than the dump's "
                                               "limit of 2097152: use a larger --page-size"),
])
def test_bad_input_is_a_clear_error(tmp_path, capsys, options, message):
    code, out = dump(tmp_path, *options)
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("dcp-compile dump: error: ") and message in err, err
    assert not out.exists()  # rejected before anything is written


@pytest.mark.parametrize("argv, line", [
    (["dump", "--out", "x", "--batch", "four"],
     "dcp-compile dump: error: argument --batch: must be an int, got 'four' (see dcp-compile dump --help)"),
    (["dump"], "dcp-compile dump: error: the following arguments are required: --out (see dcp-compile dump --help)"),
    ([], "dcp-compile: error: the following arguments are required: {demo,dump,doctor} (see dcp-compile --help)"),
])
def test_a_bad_command_line_is_one_line_not_the_usage_block(tmp_path, capsys, monkeypatch, argv, line):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert capsys.readouterr().err == line + "\n"
    assert list(tmp_path.iterdir()) == []


def test_an_empty_output_folder_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["dump", "--model", "tiny", "--layers", "1", "--out", ""]) == 2
    assert capsys.readouterr().err == "dcp-compile dump: error: --out must name a folder, got ''\n"
    assert list(tmp_path.iterdir()) == []


def test_a_long_context_dump_of_a_real_model_fits_the_limits(tmp_path):
    """Kimi-K2's 128k context at a batch of 256, with pages as engines make them."""
    code, out = dump(tmp_path, "--model", "kimi-k2", "--layers", "1", "--context", "131072", "--batch", "256",
                     "--page-size", "64", "--only", "gather_q_attention")
    assert code == 0
    before = (out / "graph00" / snapshot_name(PASS_NAMES.index("gather_q_attention"), "gather_q_attention", "before"))
    assert 'L_req_to_token_: "i64[256, 131073]"' in before.read_text()


def test_output_folder_that_cannot_be_written(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = main(["dump", "--model", "tiny", "--out", str(blocker / "out")])
    assert code == 2
    assert f"cannot write to output folder {blocker / 'out'}" in capsys.readouterr().err


def test_a_full_disk_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    def disk_full(writer, graph_index, report):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(writer.graph_folder(graph_index) / REPORT_JSON))

    monkeypatch.setattr(text_dump.TextDump, "pipeline_done", disk_full)
    code, out = dump(tmp_path, "--model", "tiny", "--layers", "1")
    assert code == 2
    assert capsys.readouterr().err == (f"dcp-compile dump: error: OSError: [Errno 28] No space left on device: "
                                       f"'{out / 'graph00' / REPORT_JSON}'\n")


def test_environment_variable_writes_the_same_files(tmp_path, monkeypatch, tiny_html):
    """DCP_COMPILE_DUMP on an apply() run goes through the same writer as the CLI."""
    monkeypatch.setenv("DCP_COMPILE_DUMP", str(tmp_path))
    cfg = preset("tiny")
    model = MLAModel(cfg, kv_capacity=64, max_requests=2)
    compiled = dcp_compile.apply(model, 1)
    table = RequestTable(2, 8, 64)
    compiled(*table.extend_batch([0, 1], [[1, 2], [3]]).args())
    written = sorted(p.name for p in (tmp_path / "graph00").iterdir())
    from_cli = sorted(p.name for p in (tiny_html / "graph00").iterdir())
    assert written == from_cli
    report = json.loads((tmp_path / "graph00" / REPORT_JSON).read_text())
    assert [p["name"] for p in report["passes"]] == list(PASS_NAMES)
    torch._dynamo.reset()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium to render the page with")
def test_page_renders_in_headless_chromium(tiny_html, tmp_path):
    """The documented screenshot check, automated where Chromium exists (CI does not need it)."""
    shot = tmp_path / "dump.png"
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={tempfile.mkdtemp()}", f"--screenshot={shot}", "--window-size=1400,1000",
               (tiny_html / "index.html").as_uri()]
    subprocess.run(command, capture_output=True, timeout=120, check=False)
    assert shot.exists() and shot.stat().st_size > 20_000  # a blank page compresses to a few KB
