"""The tables of bench results (bench.lib.result's schema): each script prints its result with
these, and `python -m bench.report` prints any result file with them.

`lines(result)` gives a benchmark's own tables where it has them (TABLES), else one markdown table
per part and the run's figures. `speed_targets` checks issue 10's targets across a bench.lowerings
and a bench.dcp_step result.
"""

from __future__ import annotations

import io
import json

from bench.lib.result import MAIN, parts, rows


def lines(result: dict) -> list[str]:
    return TABLES.get(result["benchmark"], generic)(result)


def header(result: dict) -> str:
    machine, versions = result["machine"], result["versions"]
    where = machine.get("gpu") or machine.get("device") or machine.get("name") or machine.get("host")
    return (f"{result['benchmark']}: {result.get('command')} ({result.get('date') or 'no date'}; {where}; "
            f"torch {versions.get('torch')})")


def _us(seconds, digits: int = 1) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.{digits}f}"


def _context(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


# --- any result -----------------------------------------------------------------------------------


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _flat(row: dict) -> dict:
    """One level of nesting as dotted columns (lowerings' {"triton": {"seconds": ...}})."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update({f"{key}.{inner}": v for inner, v in value.items()})
        else:
            out[key] = value
    return out


def markdown(records: list[dict]) -> list[str]:
    flat = [_flat(r) for r in records]
    columns = list(dict.fromkeys(key for r in flat for key in r))
    return (["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
            + ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in flat])


def generic(result: dict) -> list[str]:
    out = []
    for part in parts(result):
        out += ["", f"{part}:", *markdown(rows(result, part))]
    if result["run"]:
        out += ["", "run:", *(f"  {key}: {_cell(value)}" for key, value in result["run"].items())]
    return out


# --- bench.step -----------------------------------------------------------------------------------


def combo(row: dict) -> str:
    """'lowering + inner compiler', '+ skinny' where the projections ran the skinny-matmul kernel,
    '+ folded verify' where verify ran the folded Triton kernel on a back end whose own is another."""
    folded = row.get("verify_attention") == "folded" and row["lowering"] != "triton"
    return (f"{row['lowering']} + {row['inner_compile']}" + (" + skinny" if row.get("skinny_matmuls") == "on" else "")
            + (" + folded verify" if folded else ""))


def step(result: dict) -> list[str]:
    out = ["| lowering + inner compiler | context | batch | k | step ms | floor ms | of floor | attention ms | rest ms | first call s |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows(result, MAIN):
        if r["step_seconds"] != r["step_seconds"]:
            out.append(f"| {combo(r)} | {r['context']} | {r['batch']} | {r['k']} | "
                       f"failed: {r.get('error', '?')[:60]} | | | | | |")
            continue
        out.append(f"| {combo(r)} | {_context(r['context'])} | {r['batch']} | {r['k']} | "
                   f"{r['step_seconds'] * 1e3:.2f} | {r['floor_seconds'] * 1e3:.2f} | {r['fraction_of_floor']:.0%} | "
                   f"{r['attention_seconds'] * 1e3:.2f} | {r['rest_seconds'] * 1e3:.2f} | {r.get('compile_seconds', 0):.1f} |")
    out += ["", "| lowering + inner compiler | cold compile s | warm compile s |", "| --- | ---: | ---: |"]
    for c in rows(result, "compile"):
        warm = c.get("warm_seconds")
        out.append(f"| {combo(c)} | {c['cold_seconds']:.1f} | {'' if warm is None else f'{warm:.1f}'} |")
    return out + list(result["run"].get("targets", []))


def profile_case(row: dict, layers: int) -> list[str]:
    """One case of bench.profile_step: per-layer time by kernel class, and the top kernels."""
    s, alone = row["step"], row["attention_layer_alone"]
    out = [f"k {row['k']} b {row['batch']} ctx {row['context']}: step {s['step_seconds'] * 1e3:.2f} ms, kernels "
           f"{s['kernel_seconds'] * 1e3:.2f} ms ({s['kernels_per_step']:.0f} a step), idle {s['idle_seconds'] * 1e3:.2f} ms; "
           f"first call {row['compile_seconds']:.1f} s"]
    out += [f"    {label:>18}: {us:8.1f} us a layer"
            for label, us in sorted(s["per_layer_us"].items(), key=lambda item: -item[1])]
    out.append(f"    attention layer alone: {alone['step_seconds'] * 1e6:.1f} us, kernels {alone['kernel_seconds'] * 1e6:.1f} us "
               f"({alone['kernels_per_step']:.0f})")
    out += [f"      {kernel['seconds_per_step'] / layers * 1e6:8.1f} us/layer x{kernel['calls_per_step'] / layers:5.2f} "
            f"[{kernel['class']}] {kernel['name'][:90]}" for kernel in s["top_kernels"][:12]]
    out += [f"      alone {kernel['seconds_per_step'] * 1e6:8.1f} us x{kernel['calls_per_step']:3.0f} [{kernel['class']}] "
            f"{kernel['name'][:90]}" for kernel in alone["top_kernels"][:8]]
    return out


def profile_step(result: dict) -> list[str]:
    layers = result["run"]["layers"]
    return [line for row in rows(result, MAIN) for line in profile_case(row, layers)]


# --- bench.decode ---------------------------------------------------------------------------------

DECODE_TARGETS = {
    "attention_fraction_of_copy": 0.75,  # at 128k, batch >= 4, 32 and 64 heads
    "dcp2_over_dcp1_batch64": 0.55,  # 128k context
    "dcp2_over_dcp1_batch4": 0.70,
    "graph_speedup": 3.0,
    "pack_merge_us": 10.0,
    "capacity_ratio": 1.99,
}


def _decode_layer(result: dict) -> list[str]:
    copy = result["run"].get("copy", {}).get("bytes_per_s")
    steps = {(r["dcp_size"], r["context"], r["batch"]): r["step_seconds"] for r in rows(result, "attention_layer")}
    comms = {(r["context"], r["batch"]): r for r in rows(result, "kernel_and_comms")}
    out = ["| context | batch | DCP=1 layer (us) | DCP=2 layer (us) | DCP2/DCP1 | attn DCP1 (us, % copy BW) | attn DCP2 (us, % copy BW) | Q all-gather (us) | all-to-all (us) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (dcp, context, batch), one in sorted(steps.items()):
        if dcp != 1:
            continue
        two = steps[(2, context, batch)]
        c = comms[(context, batch)]
        frac = (lambda n: f"{c[f'attention_dcp{n}_kv_bytes_per_s'] / copy:.0%}" if copy else "-")
        out.append(f"| {context} | {batch} | {_us(one)} | {_us(two)} | {two / one:.2f} | "
                   f"{_us(c['attention_dcp1_seconds'])} ({frac(1)}) | {_us(c['attention_dcp2_seconds'])} ({frac(2)}) | "
                   f"{_us(c['q_all_gather_seconds'])} | {_us(c['all_to_all_seconds'])} |")
    return out


def _decode_stack(result: dict) -> list[str]:
    steps = {(r["dcp_size"], r["context"], r["batch"]): r["step_seconds"] for r in rows(result, "model_stack")}
    out = ["| context | batch | DCP=1 step (us) | DCP=2 step (us) | DCP2/DCP1 |", "| --- | --- | --- | --- | --- |"]
    for (dcp, context, batch), one in sorted(steps.items()):
        if dcp == 1:
            two = steps[(2, context, batch)]
            out.append(f"| {context} | {batch} | {_us(one)} | {_us(two)} | {two / one:.2f} |")
    return out


def _decode_targets(result: dict) -> list[str]:
    out = []
    layer = rows(result, "attention_layer")
    steps = {(r["dcp_size"], r["context"], r["batch"]): r["step_seconds"] for r in layer}
    longest = max(r["context"] for r in layer)
    for batch, key in ((64, "dcp2_over_dcp1_batch64"), (4, "dcp2_over_dcp1_batch4")):
        if (1, longest, batch) in steps:
            ratio = steps[(2, longest, batch)] / steps[(1, longest, batch)]
            out.append(f"DCP2/DCP1 layer time at {longest} ctx, batch {batch}: {ratio:.2f} (target <= {DECODE_TARGETS[key]})")
    copy = result["run"].get("copy", {}).get("bytes_per_s")
    if copy:
        for c in rows(result, "kernel_and_comms"):
            if c["context"] == longest and c["batch"] >= 4:
                out.append(f"attention KV bandwidth at {longest} ctx, batch {c['batch']}: 32 heads "
                           f"{c['attention_dcp1_kv_bytes_per_s'] / copy:.0%}, 64 heads "
                           f"{c['attention_dcp2_kv_bytes_per_s'] / copy:.0%} of copy (target >= 75%)")
    pm = result["run"]["pack_merge"]
    out.append(f"pack + merge at batch {pm['batch']}: {_us(pm['seconds'])} us (target <= {DECODE_TARGETS['pack_merge_us']})")
    for g in rows(result, "graph_speedup"):
        out.append(f"graph replay speedup, tiny 4-layer, batch 1, DCP {g['dcp_size']}: {g['speedup']:.1f}x "
                   f"(target >= 3x), matches eager: {g['graph_matches_eager']}")
    cap = result["run"]["capacity"]
    out.append(f"KV capacity at {cap['memory_fraction']:.0%} memory, {cap['model']} {cap['layers']} layers: "
               f"{cap['tokens_dcp1']} -> {cap['tokens_dcp2']} tokens per rank group, ratio {cap['ratio']:.4f} (target >= 1.99)")
    return out


def decode(result: dict) -> list[str]:
    out = []
    if "copy" in result["run"]:
        out.append(f"device-to-device copy: {result['run']['copy']['bytes_per_s'] / 1e12:.2f} TB/s (read + write)")
    out += ["", "One MLA decode attention layer (Kimi-K2, TP 2):", *_decode_layer(result),
            "", "Stack of 4 reference-model layers:", *_decode_stack(result), "", "Targets:", *_decode_targets(result)]
    errors = {r.get("capture_error") for r in rows(result, "attention_layer") if r.get("capture_error")}
    if errors:
        out += ["", "Graph capture failed (timed eagerly):", *(f"  {e}" for e in errors)]
    return out


# --- bench.kernels --------------------------------------------------------------------------------


def kernels(result: dict) -> list[str]:
    run = result["run"]
    copy = run["copy"]["bytes_per_s"]
    out = [f"{result['machine'].get('gpu')}: device-to-device copy {copy / 1e12:.2f} TB/s (read + write)",
           f"{'heads':>5} {'context':>8} {'batch':>5} {'splits':>6} {'time us':>9} {'KV TB/s':>8} {'of copy':>8}"]
    for row in rows(result, "attention"):
        if "seconds" not in row:
            out.append(f"{row['heads']:>5} {row['context']:>8} {row['batch']:>5}  {row.get('error', row.get('skipped'))}")
            continue
        out.append(f"{row['heads']:>5} {row['context']:>8} {row['batch']:>5} {row['tiling']['num_splits']:>6} "
                   f"{row['seconds'] * 1e6:>9.1f} {row['kv_bytes_per_s'] / 1e12:>8.2f} {row['fraction_of_copy']:>8.1%}")
    sweep = rows(result, "sweep")
    if sweep:
        out += ["", f"tiling sweep (context {sweep[0]['context']}):"]
        for row in sweep:
            figure = f"{row['fraction_of_copy']:.1%} of copy" if "seconds" in row else row["error"]
            out.append(f"  heads {row['heads']:>3} batch {row['batch']:>3} {row['tiling']}: {figure}")
    pm = run.get("pack_merge")
    if pm and "pack_merge_us" in pm:
        out += ["", f"pack + merge (batch {pm['batch']}, {pm['heads_per_rank']} heads/rank, N={pm['dcp_size']}): "
                    f"{pm['pack_merge_us']:.1f} us (pack {pm['pack_us']:.1f}, merge {pm['merge_us']:.1f}; "
                    f"torch reference {pm['torch_reference_pack_merge_us']:.1f}); target <= {pm['target_us']} us"]
    md = run.get("local_metadata")
    if md:
        out.append(f"local metadata (batch {md['batch']}, context {md['context']}, N={md['dcp_size']}): {md['us']:.1f} us")
    return out + list(run.get("targets", []))


# --- bench.lowerings, bench.dcp_step and their targets (issue 10) ----------------------------------


KERNEL_NAMES = {"triton": "Triton", "folded": "folded", "flashinfer": "FlashInfer"}


def kernel_table(lowerings: dict, context: int) -> list[str]:
    present = [name for name in KERNEL_NAMES if any(name in row for row in rows(lowerings, MAIN))]
    out = ["| heads | batch | k | bound | floor (us) | "
           + " | ".join(f"{KERNEL_NAMES[name]} (us, % copy, % floor)" for name in present) + " |",
           "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in present) + " |"]
    for row in rows(lowerings, MAIN):
        if row["context"] != context or "skipped" in row:
            continue
        cells = []
        for name in present:
            cell = row.get(name, {})
            cells.append(f"{_us(cell['seconds'], 0)}, {cell['fraction_of_copy']:.0%}, {cell['fraction_of_floor']:.0%}"
                         if "seconds" in cell else cell.get("error", "-")[:40])
        out.append(f"| {row['heads']} | {row['batch']} | {row['k']} | {row['bound']} | {_us(row['floor_seconds'], 0)} | "
                   + " | ".join(cells) + " |")
    return out


def lowerings(result: dict) -> list[str]:
    run, versions = result["run"], result["versions"]
    out = [f"copy {run.get('copy', {}).get('bytes_per_s', 0) / 1e12:.2f} TB/s, bf16 matmul "
           f"{run.get('matmul_flops_per_s', 0) / 1e12:.0f} TFLOP/s; flashinfer "
           f"{run.get('flashinfer_unavailable') or versions.get('flashinfer')}"]
    if "flashinfer_setup" in run:
        out.append(f"flashinfer setup: { {k: round(v, 1) for k, v in run['flashinfer_setup'].items()} }")
    for context in sorted({r["context"] for r in rows(result, MAIN)}):
        out += ["", f"attention at context {context}:", *kernel_table(result, context)]
    skipped = [r for r in rows(result, MAIN) if "skipped" in r]
    if skipped:
        out.append(f"{len(skipped)} cases skipped: {skipped[0]['skipped']}")
    for row in rows(result, "torch_reference"):
        out.append(f"torch reference, 32 heads, ctx {row['context']}, batch 4, k {row['k']}: {row['seconds'] * 1e6:.0f} us "
                   f"({row['fraction_of_copy']:.1%} of copy)")
    if "agreement" in run:
        out.append(f"against flashinfer at the largest case: {run['agreement']}")
    if "agreement_verify" in run:
        out.append(f"against flashinfer at verify: {run['agreement_verify']}")
    for row in rows(result, "folded_sweep"):
        seconds = f"{row['seconds'] * 1e6:.0f} us" if "seconds" in row else row["error"][:60]
        out.append(f"folded sweep, {row['heads']} heads, ctx {row['context']}, batch 4, k 7, {row['tiling']}: {seconds}")
    return out


def ratio_table(dcp_step_result: dict, part: str) -> list[str]:
    out = ["| lowering | context | batch | k | DCP=1 (us) | DCP=2 (us) | DCP2 / DCP1 | DCP2 / FlashInfer DCP1 |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows(dcp_step_result, f"{part}_ratios"), key=lambda r: (r["lowering"], r["context"], r["k"], r["batch"])):
        same, other = r["dcp2_over_dcp1"], r["dcp2_over_flashinfer_dcp1"]
        out.append(f"| {r['lowering']} | {r['context']} | {r['batch']} | {r['k']} | "
                   f"{_us(r['dcp1_same_lowering_seconds'], 0)} | {_us(r['dcp2_seconds'], 0)} | "
                   f"{'-' if same is None else f'{same:.3f}'} | {'-' if other is None else f'{other:.3f}'} |")
    return out


def dcp_step(result: dict) -> list[str]:
    out = []
    for part in ("layer", "stack"):
        measured = rows(result, part)
        if not measured:
            continue
        out += ["", f"{part}: DCP = 2 over DCP = 1", *ratio_table(result, part)]
        for r in measured:
            if "error" in r or "capture_error" in r:
                where = {k: r[k] for k in ("lowering", "dcp_size", "context", "batch", "k")}
                out.append(f"  error: {where} {r.get('error') or r.get('capture_error')}")
    return out


def speed_targets(lowerings_result: dict, dcp_step_result: dict) -> list[str]:
    """Issue 10's targets, over a bench.lowerings and a bench.dcp_step result."""
    out = ["| target (issue 10) | measured | met |", "| --- | --- | --- |"]
    kernel_cases = rows(lowerings_result, MAIN)
    longest = max(r["context"] for r in kernel_cases)

    def cases(**want):
        return [r for r in kernel_cases if "skipped" not in r and all(r[k] in v for k, v in want.items())]

    decode_shares = [r["flashinfer"]["fraction_of_copy"] for r in cases(context=[longest], k=[1], batch=[4, 16, 64],
                                                                        heads=[32, 64])]
    out.append(f"| decode attention reads KV at >= 75% of copy (128k, batch >= 4, 32/64 heads) | FlashInfer "
               f"{min(decode_shares):.0%}-{max(decode_shares):.0%} | {'yes' if min(decode_shares) >= 0.75 else 'no'} |")
    for name, goal in (("flashinfer", 0.70), ("triton", 0.40)):
        for k in (7, 16):
            shares = [r[name]["fraction_of_floor"] for r in cases(context=[longest], k=[k], batch=[4, 16], heads=[32, 64])]
            out.append(f"| verify k = {k} at >= {goal:.0%} of the roofline floor ({name}, 128k, batch 4/16) | "
                       f"{min(shares):.0%}-{max(shares):.0%} | {'yes' if min(shares) >= goal else 'no'} |")
    layer = {(r["batch"], r["k"]): r["dcp2_over_dcp1"] for r in rows(dcp_step_result, "layer_ratios")
             if r["lowering"] == "flashinfer" and r["context"] == longest}
    for (batch, k), goal in (((64, 1), 0.55), ((4, 1), 0.70), ((4, 7), 1.05), ((16, 7), 1.05)):
        value = layer.get((batch, k))
        out.append(f"| layer DCP2/DCP1 <= {goal} ({'decode' if k == 1 else 'verify k = 7'}, 128k, batch {batch}) | "
                   f"{value:.3f} | {'yes' if value <= goal else 'no'} |")
    stack = {(r["batch"], r["k"]): r["dcp2_over_flashinfer_dcp1"] for r in rows(dcp_step_result, "stack_ratios")
             if r["lowering"] == "flashinfer" and r["context"] == longest}
    for (batch, k), goal in (((4, 1), 0.75), ((4, 7), 1.05)):
        value = stack.get((batch, k))
        out.append(f"| 61-layer stack DCP2 <= {goal} x FlashInfer DCP1 ({'decode' if k == 1 else 'verify k = 7'}, 128k, "
                   f"batch {batch}) | {value:.3f} | {'yes' if value <= goal else 'no'} |")
    return out


# --- bench.pass_pipeline --------------------------------------------------------------------------


def _rich(table) -> list[str]:
    from rich.console import Console

    text = io.StringIO()
    Console(file=text, width=160).print(table)
    return text.getvalue().rstrip("\n").split("\n")


def pass_pipeline(result: dict) -> list[str]:
    from rich.table import Table

    run = result["run"]
    table = Table(title=f"pass pipeline, {run['model']} decode graph (batch {run['batch']}), median of {run['repeats']}")
    for column in ("DCP x TP", "layers", "nodes before -> after", "MLA sites", "all passes ms", "ms / layer",
                   "verify ms", "gather_q_attention ms", "capture s"):
        table.add_column(column, justify="right")
    for r in rows(result, MAIN):
        table.add_row(f"{r['dcp_size']} x {r['tp_size']}", str(r["layers"]), f"{r['nodes_before']} -> {r['nodes_after']}",
                      str(r["mla_sites_rewritten"]), f"{r['median_ms']:.0f}", f"{r['median_ms'] / r['layers']:.1f}",
                      f"{r['pass_median_ms'].get('verify', 0):.0f}", f"{r['pass_median_ms'].get('gather_q_attention', 0):.0f}",
                      f"{r['capture_seconds']:.1f}")
    out = _rich(table)
    for dcp, goal in run["goal"]["per_dcp"].items():
        fit = run["linear_fit"][dcp]
        out.append(f"DCP {dcp}: {goal['layers']} layers in {goal['median_ms']:.0f} ms "
                   f"({'meets' if goal['under_1s'] else 'MISSES'} the < 1 s goal); linear fit "
                   f"{fit['ms_per_layer']:.2f} ms/layer + {fit['intercept_ms']:.0f} ms, R^2 = {fit['r_squared']:.3f}")
    return out


TABLES = {"step": step, "profile_step": profile_step, "decode": decode, "kernels": kernels, "lowerings": lowerings,
          "dcp_step": dcp_step, "pass_pipeline": pass_pipeline}
"""A benchmark's own tables; any other is shown by `generic`."""
