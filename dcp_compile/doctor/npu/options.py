"""Which settings are safe here: the NPU back end's option values and the run settings the checks
gate (NPU graphs, DCP over HCCL, torchair), judged from the checks' verdicts and from
lowering/npu/versions.py's rules for this deployment.

A setting is `unsafe` where a check that gates it FAILed or a version rule refuses it,
`unchecked` where a check it rests on was skipped or not run, else `safe`. Each option's
`recommended` value is its default where that is not unsafe, else the first safe alternative.
"""

from __future__ import annotations

import dataclasses

from dcp_compile.lowering.npu import versions
from dcp_compile.lowering.npu.options import NPUOptions

OPTION_FIELDS = ("npu_kernels", "npu_kv_format", "fia_version", "npu_verify", "fia_block_sizes")
"""The NPUOptions fields a deployment decides (torchair_mode is torchair's own)."""
BACK_END = "kernels='npu'"
"""The NPU back end under any option set."""
RUN_SETTINGS = {
    BACK_END: "the NPU back end, any option set",
    "dcp_size > 1": "the KV cache sharded over ranks: partials merged by their LSE",
    "--graphs": "steps replayed from NPU graphs (GraphRunner, the demo's --graphs)",
    "--graphs with fia_version=2": "NPU graphs of FIA v2 calls",
    "--graphs with dcp_size > 1": "NPU graphs holding the DCP exchange (HCCL collectives)",
    "inner_compile='torchair'": "torchair as the inner compiler",
    "fewer than 8 query heads per FIA call": "a model whose FIA call sees fewer than 8 heads (heads per rank x DCP)",
}

NOT_CHECKED = {"npu_kernels='triton'": "the doctor runs no Triton kernel: their build by triton-ascend on this "
                                       "device is not checked here"}
"""Settings no check can vouch for: unchecked, unless a check or a version rule makes them unsafe."""


def setting(name: str, value) -> str:
    return f"{name}={value!r}"


def option_settings() -> list[tuple[str, object, str]]:
    """(field, value, setting) for every choice of the deployment's options, defaults first."""
    found = []
    for field in dataclasses.fields(NPUOptions):
        if field.name in OPTION_FIELDS:
            choices = sorted(field.metadata["choices"], key=lambda value: value != field.default)
            found.extend((field.name, value, setting(field.name, value)) for value in choices)
    return found


def known_settings() -> list[str]:
    return [name for _, _, name in option_settings()] + list(RUN_SETTINGS)


def _verdict(unsafe: list[str], unchecked: list[str]) -> str:
    return "unsafe" if unsafe else "unchecked" if unchecked else "safe"


def judge(checks, results: dict, deployment: versions.Deployment) -> dict:
    """{"settings": [{setting, verdict, unsafe, unchecked, advisories}], "recommended": {field: value
    or None}} from the run's results (by name) and every check of the catalogue (those not run
    leave their settings unchecked). The version rules that refuse the default option set make
    the back end itself unsafe; an advisory goes to the setting it names first."""
    needs = {name: [] for name in known_settings()}
    for check in checks:
        for gated in check.gates:
            needs[gated].append(check.name)
    failed_by = {name: [] for name in needs}
    for result in results.values():
        for gated in result.unsafe:
            failed_by[gated].append(f"{result.name} FAILed ({result.source['doc']})" if result.verdict == "FAIL"
                                    else f"{result.name}: {result.detail}")
    base_refusals = versions.unsupported_reasons(NPUOptions(), deployment)
    failed_by[BACK_END] += base_refusals
    rows = []
    for field, value, name in option_settings():
        options = dataclasses.replace(NPUOptions(), **{field: value})
        refusals = [reason for reason in versions.unsupported_reasons(options, deployment) if reason not in base_refusals]
        advisories = [text for text in versions.advisories(options, deployment) if text.startswith(name)]
        rows.append(_row(name, failed_by[name] + refusals, needs[name], results, advisories))
    for name, text in RUN_SETTINGS.items():
        rows.append({**_row(name, failed_by[name], needs[name], results, []), "means": text})
    verdicts = {row["setting"]: row["verdict"] for row in rows}
    recommended = {}
    for field, value, name in option_settings():  # defaults first
        if recommended.get(field) is None:
            recommended[field] = value if verdicts[name] != "unsafe" else None
    return {"settings": rows, "recommended": recommended}


def _row(name: str, unsafe: list[str], needed: list[str], results: dict, advisories: list[str]) -> dict:
    unchecked = [f"{check} not run" if check not in results else f"{check} skipped: {results[check].detail}"
                 for check in needed if check not in results or results[check].verdict == "SKIP"]
    unchecked += [NOT_CHECKED[name]] if name in NOT_CHECKED else []
    return {"setting": name, "verdict": _verdict(unsafe, unchecked), "unsafe": unsafe, "unchecked": unchecked,
            "advisories": advisories}
