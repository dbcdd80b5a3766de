"""The doctor's report as tables: each check with its verdict, source and measured values; then
each setting with its verdict and why; then the deployment and the options to use."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dcp_compile.doctor.npu.options import BACK_END

STYLES = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow", "safe": "green", "unsafe": "bold red",
          "unchecked": "yellow"}


def _styled(text: str) -> str:
    return f"[{STYLES[text]}]{text}[/]"


def _measured(check: dict) -> str:
    shown = ", ".join(f"{key}={value}" for key, value in check["measured"].items() if key != "traceback")
    return "; ".join(part for part in (shown, check["detail"]) if part)


def render(report: dict, console: Console) -> None:
    title = f"dcp-compile doctor --device npu ({report['mode']}{', plant ' + report['plant'] if report['plant'] else ''})"
    checks = Table(title=title, title_justify="left")
    for column in ("check", "verdict", "source", "measured / detail"):
        checks.add_column(column)
    for check in report["checks"]:
        checks.add_row(check["name"], _styled(check["verdict"]),
                       escape(f"{check['source']['doc']}\n{check['source']['upstream']}"), escape(_measured(check)))
    console.print(checks)

    rows = Table(title="settings on this machine", title_justify="left")
    for column in ("setting", "verdict", "why"):
        rows.add_column(column)
    for row in report["settings"]:
        why = row["unsafe"] or row["unchecked"]
        rows.add_row(row["setting"], _styled(row["verdict"]), escape("\n".join(why + row["advisories"])))
    console.print(rows)

    deployment = report["deployment"]
    console.print(escape(f"deployment: SoC {deployment['soc']} ({deployment['family'] or 'no known family'}), CANN "
                         f"{deployment['cann']}, torch_npu {deployment['torch_npu']}, triton-ascend "
                         f"{deployment['triton_ascend']}, driver {deployment['driver']}"))
    back_end = next(row for row in report["settings"] if row["setting"] == BACK_END)
    if back_end["verdict"] == "unsafe":
        console.print(escape("the NPU back end is not safe here: " + "; ".join(back_end["unsafe"])), style=STYLES["unsafe"])
    recommended = ", ".join(f"{field}={value!r}" if value is not None else f"{field}: no safe value"
                            for field, value in report["recommended"].items())
    console.print(escape(f"options to use here: {recommended}"))
    summary = report["summary"]
    console.print(f"{summary['passed']} PASS, {summary['failed']} FAIL, {summary['skipped']} SKIP in "
                  f"{summary['seconds']:.0f} s")
