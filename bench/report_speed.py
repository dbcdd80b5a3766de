"""Markdown tables, target checks and the plot for bench/lowerings.py and bench/dcp_step.py results.

    python bench/report_speed.py bench/results/lowerings_h200.json bench/results/dcp_step_h200x2.json \
        --plot bench/results/speed_h200x2.png

The plot needs matplotlib (a bench tool, not a dependency of the package).
"""

from __future__ import annotations

import argparse
import json


def _us(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.0f}"


def kernel_table(lowerings: dict, context: int = 131072) -> list[str]:
    lines = ["| heads | batch | k | bound | floor (us) | Triton (us, % copy, % floor) | FlashInfer (us, % copy, % floor) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in lowerings["cases"]:
        if row["context"] != context or "skipped" in row:
            continue
        cells = []
        for name in ("triton", "flashinfer"):
            cell = row.get(name, {})
            cells.append(f"{_us(cell['seconds'])}, {cell['fraction_of_copy']:.0%}, {cell['fraction_of_floor']:.0%}"
                         if "seconds" in cell else cell.get("error", "-")[:40])
        lines.append(f"| {row['heads']} | {row['batch']} | {row['k']} | {row['bound']} | {_us(row['floor_seconds'])} | "
                     + " | ".join(cells) + " |")
    return lines


def ratio_table(step: dict, part: str) -> list[str]:
    lines = ["| lowering | context | batch | k | DCP=1 (us) | DCP=2 (us) | DCP2 / DCP1 | DCP2 / FlashInfer DCP1 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(step[f"{part}_ratios"], key=lambda r: (r["lowering"], r["context"], r["k"], r["batch"])):
        same, other = r["dcp2_over_dcp1"], r["dcp2_over_flashinfer_dcp1"]
        lines.append(f"| {r['lowering']} | {r['context']} | {r['batch']} | {r['k']} | {_us(r['dcp1_same_lowering_seconds'])} | "
                     f"{_us(r['dcp2_seconds'])} | {same:.3f} | {other:.3f} |")
    return lines


def targets(lowerings: dict, step: dict) -> list[str]:
    lines = ["| target (issue 10) | measured | met |", "| --- | --- | --- |"]
    longest = max(r["context"] for r in lowerings["cases"])

    def cases(**want):
        return [r for r in lowerings["cases"] if "skipped" not in r and all(r[k] in v for k, v in want.items())]

    decode = [r["flashinfer"]["fraction_of_copy"] for r in cases(context=[longest], k=[1], batch=[4, 16, 64], heads=[32, 64])]
    lines.append(f"| decode attention reads KV at >= 75% of copy (128k, batch >= 4, 32/64 heads) | FlashInfer "
                 f"{min(decode):.0%}-{max(decode):.0%} | {'yes' if min(decode) >= 0.75 else 'no'} |")
    for name, goal in (("flashinfer", 0.70), ("triton", 0.40)):
        for k in (7, 16):
            shares = [r[name]["fraction_of_floor"] for r in cases(context=[longest], k=[k], batch=[4, 16], heads=[32, 64])]
            lines.append(f"| verify k = {k} at >= {goal:.0%} of the roofline floor ({name}, 128k, batch 4/16) | "
                         f"{min(shares):.0%}-{max(shares):.0%} | {'yes' if min(shares) >= goal else 'no'} |")
    layer = {(r["batch"], r["k"]): r["dcp2_over_dcp1"] for r in step["layer_ratios"]
             if r["lowering"] == "flashinfer" and r["context"] == longest}
    for (batch, k), goal in (((64, 1), 0.55), ((4, 1), 0.70), ((4, 7), 1.05), ((16, 7), 1.05)):
        value = layer.get((batch, k))
        lines.append(f"| layer DCP2/DCP1 <= {goal} ({'decode' if k == 1 else 'verify k = 7'}, 128k, batch {batch}) | "
                     f"{value:.3f} | {'yes' if value <= goal else 'no'} |")
    stack = {(r["batch"], r["k"]): r["dcp2_over_flashinfer_dcp1"] for r in step["stack_ratios"]
             if r["lowering"] == "flashinfer" and r["context"] == longest}
    for (batch, k), goal in (((4, 1), 0.75), ((4, 7), 1.05)):
        value = stack.get((batch, k))
        lines.append(f"| 61-layer stack DCP2 <= {goal} x FlashInfer DCP1 ({'decode' if k == 1 else 'verify k = 7'}, 128k, "
                     f"batch {batch}) | {value:.3f} | {'yes' if value <= goal else 'no'} |")
    return lines


def plot(lowerings: dict, step: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest = max(r["context"] for r in lowerings["cases"])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    ax = axes[0]
    for name, style in (("triton", "--"), ("flashinfer", "-")):
        for heads, marker in ((32, "o"), (64, "s")):
            rows = sorted((r["k"], r[name]["fraction_of_floor"]) for r in lowerings["cases"]
                          if r["context"] == longest and r["batch"] == 16 and r["heads"] == heads and "seconds" in r.get(name, {}))
            ax.plot([k for k, _ in rows], [f * 100 for _, f in rows], style, marker=marker, label=f"{name}, {heads} heads")
    ax.set(title=f"attention kernel, {longest // 1024}k context, batch 16", xlabel="queries per request (k)",
           ylabel="% of roofline floor", ylim=(0, 100))
    ax.legend(fontsize=8)
    for ax, part, title in ((axes[1], "layer", "one attention layer"), (axes[2], "stack", "61-layer Kimi-K2-shaped step")):
        for lowering, style in (("flashinfer", "-"), ("triton", "--")):
            for k, marker in ((1, "o"), (step["shapes"]["draft"], "s")):
                rows = sorted((r["batch"], r["dcp2_over_flashinfer_dcp1"]) for r in step[f"{part}_ratios"]
                              if r["lowering"] == lowering and r["context"] == longest and r["k"] == k)
                if rows:
                    ax.plot([b for b, _ in rows], [v for _, v in rows], style, marker=marker,
                            label=f"{lowering} DCP=2, {'decode' if k == 1 else f'verify k={k}'}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{title}, {longest // 1024}k:\nDCP=2 / FlashInfer DCP=1", xlabel="batch", ylabel="step time ratio")
        ax.legend(fontsize=8)
    fig.suptitle(f"{step['machine']['gpu']} x{step['machine']['gpus']}, R = 512, P = 64, bf16, CUDA graphs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lowerings")
    parser.add_argument("dcp_step")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    lowerings, step = json.load(open(args.lowerings)), json.load(open(args.dcp_step))
    for title, lines in (("kernels at 128k", kernel_table(lowerings)), ("layer", ratio_table(step, "layer")),
                         ("stack", ratio_table(step, "stack")), ("targets", targets(lowerings, step))):
        print(f"\n{title}\n" + "\n".join(lines))
    if args.plot:
        plot(lowerings, step, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
