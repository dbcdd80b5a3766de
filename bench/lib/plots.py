"""Plots of bench results (bench.lib.result's schema). They need matplotlib, a bench tool and not a
dependency of the package."""

from __future__ import annotations

from bench.lib.result import MAIN, rows


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _gpus(result: dict) -> str:
    machine = result["machine"]
    return f"{machine.get('gpu')} x{machine.get('ranks') or machine.get('gpus')}"


def decode(result: dict, path: str) -> None:
    """bench.decode: the attention layer's step time over batch, DCP 1 against 2, per context."""
    plt = _pyplot()
    layer = rows(result, "attention_layer")
    contexts = sorted({r["context"] for r in layer})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for dcp in (1, 2):
            points = sorted((r["batch"], r["step_seconds"] * 1e6) for r in layer
                            if r["context"] == context and r["dcp_size"] == dcp)
            ax.plot([b for b, _ in points], [t for _, t in points], marker="o", label=f"DCP={dcp}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"decode attention layer, context {context}")
        ax.set_xlabel("batch")
        ax.set_ylabel("step time (us)")
        ax.legend()
    fig.suptitle(f"{_gpus(result)}, Kimi-K2 shapes, TP 2, CUDA graphs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def step(result: dict, path: str, combo) -> None:
    """bench.step: each case's step time per combination (`combo(row)` names it) beside its floor."""
    plt = _pyplot()
    cases = rows(result, MAIN)
    contexts = sorted({r["context"] for r in cases})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.2), squeeze=False)
    combos = sorted({combo(r) for r in cases})
    for ax, context in zip(axes[0], contexts):
        at_context = [r for r in cases if r["context"] == context]
        labels = sorted({(r["k"], r["batch"]) for r in at_context})
        width = 0.8 / (len(combos) + 1)
        for i, name in enumerate(combos):
            values = [next((r["step_seconds"] * 1e3 for r in at_context if combo(r) == name
                            and (r["k"], r["batch"]) == label), float("nan")) for label in labels]
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
        floors = [next(r["floor_seconds"] * 1e3 for r in at_context if (r["k"], r["batch"]) == label) for label in labels]
        ax.bar([x + len(combos) * width for x in range(len(labels))], floors, width, label="floor", color="black")
        ax.set_xticks([x + 0.4 for x in range(len(labels))], [f"k={k} b={b}" for k, b in labels])
        ax.set_title(f"{result['run']['shapes']['layers']}-layer step, context {context // 1024}k")
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def speed(lowerings: dict, dcp_step: dict, path: str) -> None:
    """bench.lowerings and bench.dcp_step: the kernels' share of the floor, and DCP 2 against
    FlashInfer's DCP 1 per layer and per stack."""
    plt = _pyplot()
    kernel_cases = rows(lowerings, MAIN)
    longest = max(r["context"] for r in kernel_cases)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    ax = axes[0]
    for name, style in (("triton", "--"), ("flashinfer", "-")):
        for heads, marker in ((32, "o"), (64, "s")):
            points = sorted((r["k"], r[name]["fraction_of_floor"]) for r in kernel_cases
                            if r["context"] == longest and r["batch"] == 16 and r["heads"] == heads
                            and "seconds" in r.get(name, {}))
            ax.plot([k for k, _ in points], [f * 100 for _, f in points], style, marker=marker, label=f"{name}, {heads} heads")
    ax.set(title=f"attention kernel, {longest // 1024}k context, batch 16", xlabel="queries per request (k)",
           ylabel="% of roofline floor", ylim=(0, 100))
    ax.legend(fontsize=8)
    for ax, part, title in ((axes[1], "layer", "one attention layer"), (axes[2], "stack", "61-layer Kimi-K2-shaped step")):
        ratios = rows(dcp_step, f"{part}_ratios")
        for lowering, style in (("flashinfer", "-"), ("triton", "--")):
            for k, marker in ((1, "o"), (dcp_step["run"]["shapes"]["draft"], "s")):
                points = sorted((r["batch"], r["dcp2_over_flashinfer_dcp1"]) for r in ratios
                                if r["lowering"] == lowering and r["context"] == longest and r["k"] == k)
                if points:
                    ax.plot([b for b, _ in points], [v for _, v in points], style, marker=marker,
                            label=f"{lowering} DCP=2, {'decode' if k == 1 else f'verify k={k}'}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{title}, {longest // 1024}k:\nDCP=2 / FlashInfer DCP=1", xlabel="batch", ylabel="step time ratio")
        ax.legend(fontsize=8)
    fig.suptitle(f"{_gpus(dcp_step)}, R = 512, P = 64, bf16, CUDA graphs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
