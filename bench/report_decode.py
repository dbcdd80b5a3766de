"""Tables, target checks and the plot for bench/decode.py results.

    python bench/report_decode.py bench/results/decode_h200x2.json   # prints the markdown tables
"""

from __future__ import annotations

import json
import sys

TARGETS = {
    "attention_fraction_of_copy": 0.75,  # at 128k, batch >= 4, 32 and 64 heads
    "dcp2_over_dcp1_batch64": 0.55,  # 128k context
    "dcp2_over_dcp1_batch4": 0.70,
    "graph_speedup": 3.0,
    "pack_merge_us": 10.0,
    "capacity_ratio": 1.99,
}


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def layer_table(result: dict) -> list[str]:
    copy = result.get("copy", {}).get("bytes_per_s")
    steps = {(r["dcp_size"], r["context"], r["batch"]): r["step_seconds"] for r in result["attention_layer"]}
    comms = {(r["context"], r["batch"]): r for r in result["kernel_and_comms"]}
    lines = ["| context | batch | DCP=1 layer (us) | DCP=2 layer (us) | DCP2/DCP1 | attn DCP1 (us, % copy BW) | attn DCP2 (us, % copy BW) | Q all-gather (us) | all-to-all (us) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (dcp, context, batch), one in sorted(steps.items()):
        if dcp != 1:
            continue
        two = steps[(2, context, batch)]
        c = comms[(context, batch)]
        frac = (lambda n: f"{c[f'attention_dcp{n}_kv_bytes_per_s'] / copy:.0%}" if copy else "-")
        lines.append(f"| {context} | {batch} | {_us(one)} | {_us(two)} | {two / one:.2f} | "
                     f"{_us(c['attention_dcp1_seconds'])} ({frac(1)}) | {_us(c['attention_dcp2_seconds'])} ({frac(2)}) | "
                     f"{_us(c['q_all_gather_seconds'])} | {_us(c['all_to_all_seconds'])} |")
    return lines


def stack_table(result: dict) -> list[str]:
    steps = {(r["dcp_size"], r["context"], r["batch"]): r["step_seconds"] for r in result["model_stack"]}
    lines = ["| context | batch | DCP=1 step (us) | DCP=2 step (us) | DCP2/DCP1 |", "| --- | --- | --- | --- | --- |"]
    for (dcp, context, batch), one in sorted(steps.items()):
        if dcp == 1:
            two = steps[(2, context, batch)]
            lines.append(f"| {context} | {batch} | {_us(one)} | {_us(two)} | {two / one:.2f} |")
    return lines


def targets(result: dict) -> list[str]:
    lines = []
    steps = {(r["dcp_size"], r["context"], r["batch"]): r["step_seconds"] for r in result["attention_layer"]}
    longest = max(r["context"] for r in result["attention_layer"])
    for batch, key in ((64, "dcp2_over_dcp1_batch64"), (4, "dcp2_over_dcp1_batch4")):
        if (1, longest, batch) in steps:
            ratio = steps[(2, longest, batch)] / steps[(1, longest, batch)]
            lines.append(f"DCP2/DCP1 layer time at {longest} ctx, batch {batch}: {ratio:.2f} (target <= {TARGETS[key]})")
    copy = result.get("copy", {}).get("bytes_per_s")
    if copy:
        for c in result["kernel_and_comms"]:
            if c["context"] == longest and c["batch"] >= 4:
                lines.append(f"attention KV bandwidth at {longest} ctx, batch {c['batch']}: 32 heads {c['attention_dcp1_kv_bytes_per_s'] / copy:.0%}, "
                             f"64 heads {c['attention_dcp2_kv_bytes_per_s'] / copy:.0%} of copy (target >= 75%)")
    pm = result["pack_merge"]
    lines.append(f"pack + merge at batch {pm['batch']}: {_us(pm['seconds'])} us (target <= {TARGETS['pack_merge_us']})")
    for g in result.get("graph_speedup", []):
        lines.append(f"graph replay speedup, tiny 4-layer, batch 1, DCP {g['dcp_size']}: {g['speedup']:.1f}x "
                     f"(target >= 3x), matches eager: {g['graph_matches_eager']}")
    cap = result["capacity"]
    lines.append(f"KV capacity at {cap['memory_fraction']:.0%} memory, {cap['model']} {cap['layers']} layers: "
                 f"{cap['tokens_dcp1']} -> {cap['tokens_dcp2']} tokens per rank group, ratio {cap['ratio']:.4f} (target >= 1.99)")
    return lines


def print_summary(result: dict) -> None:
    if "copy" in result:
        print(f"device-to-device copy: {result['copy']['bytes_per_s'] / 1e12:.2f} TB/s (read + write)")
    print("\nOne MLA decode attention layer (Kimi-K2, TP 2):")
    print("\n".join(layer_table(result)))
    print("\nStack of 4 reference-model layers:")
    print("\n".join(stack_table(result)))
    print("\nTargets:")
    print("\n".join(targets(result)))
    errors = {r.get("capture_error") for r in result["attention_layer"] if r.get("capture_error")}
    if errors:
        print("\nGraph capture failed (timed eagerly):", *errors, sep="\n  ")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in result["attention_layer"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for dcp in (1, 2):
            rows = sorted((r["batch"], r["step_seconds"] * 1e6) for r in result["attention_layer"]
                          if r["context"] == context and r["dcp_size"] == dcp)
            ax.plot([b for b, _ in rows], [t for _, t in rows], marker="o", label=f"DCP={dcp}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"decode attention layer, context {context}")
        ax.set_xlabel("batch")
        ax.set_ylabel("step time (us)")
        ax.legend()
    fig.suptitle(f"{result['machine']['gpu']} x{result['machine']['gpus']}, Kimi-K2 shapes, TP 2, CUDA graphs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    print_summary(json.loads(open(sys.argv[1]).read()))
