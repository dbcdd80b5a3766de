"""The torch_npu releases the emulator knows, from snapshots of each release's own wheel.

Each folder `torch_npu_<version>/` holds what `python -m dcp_compile.testing.npu_emulator.snapshot`
read from that wheel without importing torch_npu (docs/ascend.md §21): the registered schema of every
op the NPU lowering calls and of the overloads its NPU-graph handlers call at capture, the vendor's
meta (shape) functions of those ops (`meta.py`, run here on fake or meta tensors), and the NPU-graph
update rules and per-op update specs (`snapshot.json`, derived from `npugraph_source.txt`).

`$DCP_COMPILE_NPU_EMULATOR_TORCH_NPU` selects the release the emulator stands in for (default
2.13.0): the stand-ins (testing/npu_standin.py) register its schemas and check every call against
its meta functions; the emulated NPUGraph (graphs.py) captures and updates by its rules. A check
against another release (`load(version).check(...)`) needs no registration: it binds the call to that
release's schema and runs that release's meta function.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from dcp_compile.testing.npu_emulator.releases import shims

ENV = "DCP_COMPILE_NPU_EMULATOR_TORCH_NPU"
DEFAULT = "2.13.0"
FOLDER = Path(__file__).parent


class ReleaseMismatch(ValueError):
    """A call that the selected torch_npu release's schema or meta function does not give: an argument
    it does not have or types otherwise, or outputs of other shapes or dtypes than its meta function's."""


def available() -> list[str]:
    """The releases with a committed snapshot, oldest first."""
    versions = [json.loads((folder / "snapshot.json").read_text())["torch_npu"]
                for folder in FOLDER.glob("torch_npu_*") if (folder / "snapshot.json").exists()]
    return sorted(versions, key=_version_key)


def _version_key(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else -1 for part in version.replace("post", "").split("."))


def selected_version() -> str:
    version = os.environ.get(ENV) or DEFAULT
    if version not in available():
        raise ValueError(f"{ENV}={version!r}: no snapshot of that torch_npu release; committed: {available()} "
                         "(python -m dcp_compile.testing.npu_emulator.snapshot VERSION adds one)")
    return version


def selected() -> "Release":
    """The release `$DCP_COMPILE_NPU_EMULATOR_TORCH_NPU` names (default 2.13.0)."""
    return load(selected_version())


_active: "Release | None" = None


def activate(release: "Release") -> None:
    """Record the release the stand-ins registered (once a process: torch.library cannot redefine)."""
    global _active
    _active = release


def active() -> "Release":
    """The release the stand-ins registered, else the selected one: what NPU graphs and the
    stand-ins' checks follow in this process."""
    return _active or selected()


@functools.cache
def load(version: str) -> "Release":
    for folder in FOLDER.glob("torch_npu_*"):
        snapshot = json.loads((folder / "snapshot.json").read_text())
        if snapshot["torch_npu"] == version:
            return Release(version, folder, snapshot, _meta_functions(folder, snapshot))
    raise ValueError(f"no snapshot of torch_npu {version}; committed: {available()}")


def _meta_functions(folder: Path, snapshot: dict) -> dict:
    functions: dict = {}
    spec = importlib.util.spec_from_file_location(f"{__name__}.{folder.name}_meta", folder / "meta.py")
    module = importlib.util.module_from_spec(spec)
    shims.collecting(functions)
    spec.loader.exec_module(module)
    named = {op: function.__name__ for op, function in functions.items()}
    if named != snapshot["meta_functions"]:
        raise ValueError(f"{folder.name}/meta.py registers {named}, snapshot.json names {snapshot['meta_functions']}")
    return functions


def overload_name(func) -> str:
    """A schema's key in a snapshot: "op" for the default overload, "op.overload" otherwise."""
    return func._opname if func._overloadname == "default" else f"{func._opname}.{func._overloadname}"


@dataclass(frozen=True, eq=False)
class Release:
    version: str
    folder: Path
    snapshot: dict = field(repr=False)
    meta_functions: dict = field(repr=False)

    @property
    def wheel(self) -> str:
        return self.snapshot["wheel"]

    @property
    def schemas(self) -> dict[str, str]:
        """Op name ("op" or "op.overload") -> the schema the release registers."""
        return self.snapshot["schemas"]

    @property
    def update_rule(self) -> dict:
        """NPUGraph.update's rules: broadcast_one_dict, count_check ("exact", or "none: ..." where the
        check compared the records with themselves), replaces_captured_kwargs,
        requires_auto_dispatch_capture."""
        return self.snapshot["npugraph"]["update"]

    def handler(self, func_name: str) -> dict | None:
        """The NPU-graph handler of an op by `func.__name__` ("op.default", "op.out"), or None: its
        update specs ([where, index or name, key]), the overload it captures as and the helpers it
        calls (a `.default` FIA call is captured as `.out`, its outputs made by `_infer_output`)."""
        return self.snapshot["npugraph"]["handlers"].get(func_name)

    def update_keys(self, func_name: str) -> list[str]:
        handler = self.handler(func_name)
        return [key for _, _, key in handler["update_specs"]] if handler else []

    def __str__(self) -> str:
        return f"torch_npu {self.version}"

    @functools.cache
    def schema(self, name: str) -> torch.FunctionSchema:
        if name not in self.schemas:
            raise ReleaseMismatch(f"{self} registers no {name} (its snapshot holds {sorted(self.schemas)})")
        return torch._C.parse_schema(self.schemas[name])

    def bind(self, name: str, args: tuple, kwargs: dict) -> dict:
        """{argument: value} of a call, as the release's schema of `name` takes it; ReleaseMismatch
        for an argument it does not have, a missing one, or a value of another type."""
        arguments = self.schema(name).arguments
        positional = [a for a in arguments if not a.kwarg_only]
        if len(args) > len(positional):
            raise ReleaseMismatch(f"{self} {name} takes {len(positional)} positional arguments, got {len(args)}")
        bound = {a.name: value for a, value in zip(positional, args)}
        by_name = {a.name: a for a in arguments}
        for key, value in kwargs.items():
            if key not in by_name:
                raise ReleaseMismatch(f"{self} {name} has no argument {key!r}; its arguments: "
                                      f"{', '.join(by_name)}")
            if key in bound:
                raise ReleaseMismatch(f"{self} {name}: {key!r} given twice")
            bound[key] = value
        for argument in arguments:
            if argument.name not in bound:
                if not argument.has_default_value():
                    raise ReleaseMismatch(f"{self} {name}: the required argument {argument.name!r} is missing")
            elif not _fits(argument.type, bound[argument.name]):
                raise ReleaseMismatch(f"{self} {name}: {argument.name} is {argument.type} in its schema, got "
                                      f"{_describe(bound[argument.name])}")
        return bound

    def meta(self, name: str, args: tuple, kwargs: dict):
        """The release's meta function of `name` (the base op's for `.out` and `_infer_output`), run on
        fake tensors (those of the call, or meta tensors of its real ones)."""
        base, call_args, call_kwargs = self._meta_call(name, args, kwargs)
        function = self.meta_functions.get(base)
        if function is None:
            return None
        fake_mode = next((t.fake_mode for t in pytree.tree_leaves((call_args, call_kwargs))
                          if isinstance(t, FakeTensor)), None)
        try:
            if fake_mode is not None:
                with fake_mode:
                    return function(*call_args, **call_kwargs)
            metas = pytree.tree_map(_to_meta, (call_args, call_kwargs))
            return function(*metas[0], **metas[1])
        except TypeError as exc:  # an argument name the vendor's Python signature does not take
            raise ReleaseMismatch(f"{self} meta function of {base}: {exc}") from exc
        except RuntimeError as exc:  # the vendor's torch._check
            raise ReleaseMismatch(f"{self} meta function of {base} refuses the call: {str(exc).splitlines()[0]}") \
                from exc

    def _meta_call(self, name: str, args: tuple, kwargs: dict):
        if name.endswith(".out"):
            kept = {k: v for k, v in kwargs.items() if k not in ("out", "workspace")}
            return name.split(".")[0], args, kept
        for op, handler in self.snapshot["npugraph"]["handlers"].items():
            if handler.get("infer_output") == name:  # (query, value, **subset): the op's meta with key = value
                query, value = args[0], args[1]
                return op.split(".")[0], (query, value, value), kwargs
        return name, args, kwargs

    def check(self, name: str, args: tuple, kwargs: dict, outputs=None) -> None:
        """Bind the call to the release's schema, run its meta function on the call's arguments, and
        compare the meta's outputs with `outputs` (the stand-in's): the same count, shapes and dtypes.
        A `.out` call's buffers are the caller's (the stand-in checks them against the documented
        shapes, which allow a [1] LSE without the flag where the meta function gives [0], §2.2), so
        they are not compared. Raises ReleaseMismatch naming the release, the op and the difference."""
        self.bind(name, args, kwargs)
        expected = self.meta(name, args, kwargs)
        if outputs is None or name.endswith(".out") or (name not in self.meta_functions and expected is None):
            return
        got, want = pytree.tree_leaves(outputs), pytree.tree_leaves(expected)
        if len(got) != len(want):
            raise ReleaseMismatch(f"{self} {name}: {len(got)} outputs, its meta function gives {len(want)}")
        for index, (mine, theirs) in enumerate(zip(got, want)):
            if not _same_layout(mine, theirs):
                raise ReleaseMismatch(f"{self} {name}: output {index} is {_describe(mine)}, its meta function gives "
                                      f"{_describe(theirs)}")


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _fits(schema_type, value) -> bool:
    kind = schema_type.kind()
    if kind == "OptionalType":
        return value is None or _fits(schema_type.getElementType(), value)
    if kind == "ListType":
        return isinstance(value, (list, tuple)) and all(_fits(schema_type.getElementType(), v) for v in value)
    if kind == "TensorType":
        return isinstance(value, torch.Tensor)
    if kind in ("IntType", "SymIntType"):
        return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)
    if kind == "FloatType":
        return isinstance(value, (float, int, torch.SymFloat, torch.SymInt)) and not isinstance(value, bool)
    if kind == "BoolType":
        return isinstance(value, (bool, torch.SymBool))
    if kind == "StringType":
        return isinstance(value, str)
    return True


def _same_size(a, b) -> bool:
    """Equal without a guard: statically known for symbolic sizes, else by their example values."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        if statically_known_true(a == b):
            return True
        hint = [v.node.hint if isinstance(v, torch.SymInt) else v for v in (a, b)]
        return hint[0] is not None and hint[0] == hint[1]
    return a == b


def _same_layout(mine, theirs) -> bool:
    if not isinstance(mine, torch.Tensor) or not isinstance(theirs, torch.Tensor):
        return type(mine) is type(theirs)
    return (mine.dtype == theirs.dtype and mine.dim() == theirs.dim()
            and all(_same_size(a, b) for a, b in zip(mine.shape, theirs.shape)))


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} [{', '.join(_describe(v) for v in value)}]"
    return repr(value)
