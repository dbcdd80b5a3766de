"""The kernel back ends, by name: the four built in (torch, triton, flashinfer, npu) and any a
user registers, and what kernels='auto' resolves to for a KV pool.

A back end outside the package registers itself when its module is imported
(`registry.register(MyLowering())`). So that the CLI and spawned ranks find it too, name its
module in the `DCP_COMPILE_BACKENDS` environment variable (comma-separated modules), or declare
it as an entry point of the group `dcp_compile.backends` in its package: the first look-up of a
back end imports them."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import os

from dcp_compile.lowering.base import Lowering, Options
from dcp_compile.passes import manager

log = logging.getLogger("dcp_compile")
AUTO = "auto"
_LOWERINGS: dict[str, Lowering] = {}
PLUGINS_ENV = "DCP_COMPILE_BACKENDS"
ENTRY_POINT_GROUP = "dcp_compile.backends"
_plugins_loaded = False


def _load_plugins() -> None:
    """Import the back-end modules named by DCP_COMPILE_BACKENDS and the entry points (once)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(f"{PLUGINS_ENV} names the back-end module {module!r}, which does not import: {exc}") from exc
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry.load()


def register(lowering: Lowering) -> Lowering:
    """Make `lowering` available as apply(..., kernels=lowering.name)."""
    if not isinstance(lowering, Lowering) or not lowering.name or lowering.name == AUTO:
        raise ValueError(f"a lowering is a dcp_compile.lowering.base.Lowering with a name other than 'auto', got {lowering!r}")
    if lowering.name in _LOWERINGS and type(_LOWERINGS[lowering.name]) is not type(lowering):
        raise ValueError(f"a different lowering is registered as {lowering.name!r} already")
    _LOWERINGS[lowering.name] = lowering
    return lowering


def names() -> tuple[str, ...]:
    """'auto' and every registered back end."""
    _load_plugins()
    return (AUTO, *_LOWERINGS)


def get(name: str) -> Lowering:
    _load_plugins()
    if name not in _LOWERINGS:
        raise ValueError(f"kernels must be one of {list(names())}, got {name!r}")
    return _LOWERINGS[name]


def pass_names() -> tuple[str, ...]:
    """Every pass a model may run: the DCP passes and every registered back end's lowering passes."""
    _load_plugins()
    return manager.all_pass_names(p.name for lowering in _LOWERINGS.values() for p in lowering.passes())


def check_pass_names(names) -> None:
    """Raise for a name that no pass has (disabled_passes, the dump's --only)."""
    manager.check_pass_names(names, pass_names())


def inner_compilers() -> tuple[str, ...]:
    """'auto' and every inner compiler a registered back end runs under."""
    _load_plugins()
    return (AUTO, *dict.fromkeys(name for lowering in _LOWERINGS.values() for name in lowering.inner_compilers))


def option_fields() -> dict[str, tuple[dataclasses.Field, list[str]]]:
    """Every registered back end's options: name -> (its dataclass field, the back ends that read it)."""
    _load_plugins()
    found: dict[str, tuple[dataclasses.Field, list[str]]] = {}
    for name, lowering in _LOWERINGS.items():
        for field in dataclasses.fields(lowering.Options):
            found.setdefault(field.name, (field, []))[1].append(name)
    return found


def option_owners(option: str) -> list[str]:
    """The back ends whose Options have a field named `option`."""
    return option_fields().get(option, (None, []))[1]


def options_for(lowering: Lowering, given=()) -> Options:
    """`lowering`'s Options from DCPConfig.options: an instance of them, or option values by
    name; a name it does not read is an error naming the back end that does."""
    if isinstance(given, Options):
        if type(given) is not lowering.Options:
            raise ValueError(f"options {given!r} are not kernels={lowering.name!r}'s ({lowering.Options.__name__})")
        return given
    values = dict(given or ())
    known = {f.name for f in dataclasses.fields(lowering.Options)}
    for name, value in values.items():
        if name not in known:
            owners = option_owners(name)
            owner = f" is an option of kernels={owners[0]!r};" if owners else " is no option of any back end:"
            raise ValueError(f"{name}={value!r}{owner} kernels={lowering.name!r} does not read it"
                             + (f" (its options: {sorted(known)})" if known else ""))
    return lowering.Options(**values)


def resolve(kernels: str, pool, config, page_size=None) -> Lowering:
    """The back end `kernels` names, or for 'auto' the one for the pool's device: npu on an NPU;
    on CUDA flashinfer where it serves the GPU, the pool and the config (else triton, logged
    once with the reason); the torch reference elsewhere. page_size: `lowering -> page size`,
    for a caller that makes the pool the back end asks for (`pool` is then a PoolSpec, checked
    with each back end's pages)."""
    if kernels != AUTO:
        return get(kernels)
    *preferred, fallback = auto_choices(pool.device.type)
    for name in preferred:
        spec = pool if page_size is None else dataclasses.replace(pool, page_size=page_size(get(name)))
        reasons = get(name).unsupported_reasons(spec, config)
        if not reasons:
            return get(name)
        log.info("kernels='auto': %s, not %s: %s", fallback, name, "; ".join(reasons))
    return get(fallback)


def auto_choices(device_type: str) -> tuple[str, ...]:
    """The back ends kernels='auto' picks from on a device, best first; the last is taken where
    none before it serves the pool."""
    return {"npu": ("npu",), "cuda": ("flashinfer", "triton")}.get(device_type, ("torch",))


def _register_builtins() -> None:
    from dcp_compile.lowering.flashinfer.lowering import FlashInferLowering
    from dcp_compile.lowering.npu.lowering import NPULowering
    from dcp_compile.lowering.torch.lowering import TorchLowering
    from dcp_compile.lowering.triton.lowering import TritonLowering

    for lowering in (TorchLowering(), TritonLowering(), FlashInferLowering(), NPULowering()):
        register(lowering)


_register_builtins()
