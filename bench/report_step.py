"""bench/step.py's JSON as a markdown table (for the README) and a plot of each step against its floor.

    python bench/report_step.py bench/results/step_h200.json [--plot bench/results/step_h200.png]

The plot needs matplotlib (a bench tool, not a dependency of the package).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _context(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def combo(row: dict) -> str:
    """'lowering + inner compiler', '+ skinny' where the projections ran the skinny-matmul kernel."""
    return f"{row['lowering']} + {row['inner_compile']}" + (" + skinny" if row.get("skinny_matmuls") == "on" else "")


def table(result: dict) -> str:
    lines = ["| lowering + inner compiler | context | batch | k | step ms | floor ms | of floor | attention ms | rest ms | first call s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["cases"]:
        if r["step_seconds"] != r["step_seconds"]:
            lines.append(f"| {combo(r)} | {r['context']} | {r['batch']} | {r['k']} | "
                         f"failed: {r.get('error', '?')[:60]} | | | | | |")
            continue
        lines.append(f"| {combo(r)} | {_context(r['context'])} | {r['batch']} | {r['k']} | "
                     f"{r['step_seconds'] * 1e3:.2f} | {r['floor_seconds'] * 1e3:.2f} | {r['fraction_of_floor']:.0%} | "
                     f"{r['attention_seconds'] * 1e3:.2f} | {r['rest_seconds'] * 1e3:.2f} | {r.get('compile_seconds', 0):.1f} |")
    lines.append("")
    lines.append("| lowering + inner compiler | cold compile s | warm compile s |")
    lines.append("| --- | ---: | ---: |")
    for c in result["compile"]:
        warm = c.get("warm_seconds")
        lines.append(f"| {combo(c)} | {c['cold_seconds']:.1f} | "
                     f"{'' if warm is None else f'{warm:.1f}'} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in result["cases"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.2), squeeze=False)
    combos = sorted({combo(r) for r in result["cases"]})
    for ax, context in zip(axes[0], contexts):
        rows = [r for r in result["cases"] if r["context"] == context]
        labels = sorted({(r["k"], r["batch"]) for r in rows})
        width = 0.8 / (len(combos) + 1)
        for i, name in enumerate(combos):
            values = [next((r["step_seconds"] * 1e3 for r in rows if combo(r) == name
                            and (r["k"], r["batch"]) == label), float("nan")) for label in labels]
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
        floors = [next(r["floor_seconds"] * 1e3 for r in rows if (r["k"], r["batch"]) == label) for label in labels]
        ax.bar([x + len(combos) * width for x in range(len(labels))], floors, width, label="floor", color="black")
        ax.set_xticks([x + 0.4 for x in range(len(labels))], [f"k={k} b={b}" for k, b in labels])
        ax.set_title(f"{result['shapes']['layers']}-layer step, context {context // 1024}k")
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result")
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    print(table(result))
    print("\n".join(result.get("targets", [])))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
