"""The kernel back ends' options as flags of demo and dump: one flag per field of each registered
back end's Options (lowering.base.Options), its choices and help from the field's metadata. A
flag left out keeps the back end's default; a flag given for a back end that does not read it is
the back end's error at bind."""

from __future__ import annotations

import dataclasses

from dcp_compile.lowering import registry


def _flag(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _given(args):
    """(option name, its field, the flag's text) of every option flag given."""
    for name, (field, _) in registry.option_fields().items():
        text = getattr(args, f"option_{name}", None)
        if text is not None:
            yield name, field, text


def add(p) -> None:
    for name, (field, owners) in registry.option_fields().items():
        choices = field.metadata.get("flag_choices", field.metadata.get("choices"))
        typed = field.metadata.get("parse") is None and choices is not None and not isinstance(choices[0], str)
        p.add_argument(_flag(field), dest=f"option_{name}", default=None, choices=choices,
                       type=type(choices[0]) if typed else None,
                       help=f"--kernels {' or '.join(owners)}: {field.metadata.get('help', '')} (default {field.default})")


def values(args) -> dict:
    """The option values the flags gave, by name."""
    return {name: field.metadata["parse"](text) if "parse" in field.metadata else text
            for name, field, text in _given(args)}


def spelled(args) -> list[str]:
    """The option flags given, as they were typed (to reproduce a command)."""
    return [part for _, field, text in _given(args) for part in (_flag(field), str(text))]
