"""Read slices of a checkpoint's tensors from its safetensors files.

A folder holds model.safetensors.index.json and the shards it names, or one model.safetensors.
Each read asks `safe_open(...).get_slice` for one block of rows or columns and copies just that
block, so a TP rank allocates its own share of a tensor and never the whole of it. Float8 (e4m3) weights are dequantized on read
with their `<name>_scale_inv` (one fp32 scale per block of the configured shape, the last block
of a dimension partial): weight = float8 value x scale, as DeepSeek's weight_dequant.

Every value read is checked to be finite in the dtype it is read into, at no extra pass over
memory: the copy (with its conversion, or the dequantization) runs chunk by chunk, and each chunk
is summed in float32 right after it is written, while it is still in cache. A NaN or an inf makes
the sum NaN or inf; so can finite values near float32's limit (3.4e38), so only a chunk whose sum
is not finite is looked at element by element. (A float64 sum, which cannot overflow, would decide
alone, but costs 2 to 4 times as much on the CPU: the float32 sum vectorizes.)
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP8_BLOCK = (128, 128)
"""DeepSeek-V3's and Kimi-K2's block shape, where a config's quantization_config leaves it out."""
FLOAT_DTYPES = ("F32", "BF16", "F16")
READ_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes read() converts into: those a float32 sum covers (module docstring)."""
CHUNK_BYTES = 1 << 18
"""Bytes of output per step of a read: well inside a core's L2 cache."""
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000
"""safetensors' own limit on the JSON header."""
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
               "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8,
               "U64": 8, "F64": 8, "C64": 8}
"""Bytes per element of the safetensors dtypes of whole bytes."""


def _safetensors():
    try:
        import safetensors
    except ImportError:
        raise ImportError("loading a checkpoint needs the safetensors package: pip install safetensors "
                          "(or pip install 'dcp_compile[checkpoints]')") from None
    return safetensors


def check_file(path: Path) -> set[str]:
    """`path` is a whole safetensors file: an 8-byte little-endian header length, a JSON header
    (tensor name -> dtype, shape and data_offsets into the bytes after the header), then the data,
    the tensors laid end to end over all of it, each as many bytes as its shape and dtype give
    (the layout safetensors itself requires). Reads the header only; a truncated, garbage or
    inconsistent file is an error that names it. Returns the names of the file's tensors."""
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(HEADER_LENGTH_BYTES)
        if len(prefix) < HEADER_LENGTH_BYTES:
            raise ValueError(f"{path} is not a safetensors file: {size} bytes, fewer than the header length's "
                             f"{HEADER_LENGTH_BYTES}")
        length = int.from_bytes(prefix, "little")
        if length > min(size - HEADER_LENGTH_BYTES, MAX_HEADER_BYTES):
            raise ValueError(f"{path} is not a safetensors file, or is truncated: its header length {length} exceeds "
                             f"the {size - HEADER_LENGTH_BYTES} bytes that follow it")
        try:
            header = json.loads(file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object")
    data_bytes = size - HEADER_LENGTH_BYTES - length
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{path} is not a safetensors file: tensor {name} has no valid data_offsets in its header")
        if offsets[1] > data_bytes:
            raise ValueError(f"{path} is truncated: tensor {name} ends at byte {offsets[1]} of the data, which holds "
                             f"{data_bytes} bytes")
        _check_size(path, name, entry, offsets[1] - offsets[0])
        spans.append((offsets[0], offsets[1], name))
    end, previous = 0, None
    for start, stop, name in sorted(spans):
        if start < end:
            raise ValueError(f"{path} is not a safetensors file: tensor {name}'s data_offsets [{start}, {stop}) "
                             f"overlap tensor {previous}'s, which ends at byte {end}")
        if start > end:
            raise ValueError(f"{path} is not a safetensors file: no tensor holds bytes [{end}, {start}) of its data "
                             f"(tensor {name} starts at byte {start})")
        end, previous = stop, name
    if end != data_bytes:
        raise ValueError(f"{path} is not a safetensors file: its tensors end at byte {end} of the data, which holds "
                         f"{data_bytes} bytes")
    return {name for _, _, name in spans}


def _check_size(path: Path, name: str, entry: dict, span: int) -> None:
    """A tensor of a whole-byte dtype spans its shape's elements times the dtype's bytes (other
    dtypes are left to safetensors, whose error _open names the file of)."""
    shape, width = entry.get("shape"), DTYPE_BYTES.get(entry.get("dtype"))
    if width is None:
        return
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"{path} is not a safetensors file: tensor {name} has no valid shape in its header")
    if math.prod(shape) * width != span:
        raise ValueError(f"{path} is not a safetensors file: tensor {name} ({entry['dtype']}, shape {shape}) needs "
                         f"{math.prod(shape) * width} bytes, and its data_offsets span {span}")


class SafetensorsReader:
    """Slices of named tensors; use as a context manager (it keeps each file open while loading)."""

    def __init__(self, folder: str | Path, fp8_block: tuple[int, int] | None = None):
        self.folder = Path(folder)
        self.fp8_block = fp8_block or FP8_BLOCK
        self._safetensors = _safetensors()
        self._files: dict[str, object] = {}
        self._stack = ExitStack()
        index = self.folder / INDEX_FILE
        if index.is_file():
            self.source = INDEX_FILE
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {exc}") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError(f"{index} is not a safetensors index: its weight_map must map tensor names to file names")
            self.weight_map = dict(weight_map)
            by_file: dict[str, list[str]] = {}
            for name, file in self.weight_map.items():
                by_file.setdefault(file, []).append(name)
            for file, names in sorted(by_file.items()):
                if not (self.folder / file).is_file():
                    raise ValueError(f"checkpoint shard {self.folder / file} is missing: {INDEX_FILE} lists it for "
                                     f"{len(names)} tensors (e.g. {names[0]})")
            for file, names in sorted(by_file.items()):
                held = check_file(self.folder / file)
                stray = [name for name in names if name not in held]
                if stray:
                    raise ValueError(f"{index} maps tensor {stray[0]} to {self.folder / file}, which does not hold it "
                                     f"({len(stray)} such tensors)")
        elif (self.folder / SINGLE_FILE).is_file():
            self.source = SINGLE_FILE
            check_file(self.folder / SINGLE_FILE)
            self.weight_map = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        else:
            raise ValueError(f"{self.folder} has neither {INDEX_FILE} nor {SINGLE_FILE}")

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._files.clear()

    def _open(self, file: str):
        if file not in self._files:
            try:
                opened = self._safetensors.safe_open(str(self.folder / file), framework="pt")
            except self._safetensors.SafetensorError as exc:  # its message names no file
                raise ValueError(f"{self.folder / file} cannot be read as safetensors: {exc}") from None
            self._files[file] = self._stack.enter_context(opened)
        return self._files[file]

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise ValueError(f"tensor {name} is not in the checkpoint ({self.folder / self.source})")
        file = self.weight_map[name]
        return self._open(file).get_slice(name), file

    def read(self, name: str, shape: tuple[int, ...], dim: int | None = None, start: int = 0,
             stop: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of tensor `name`, whose full shape must
        be `shape`; the whole tensor where dim is None. In `dtype` (float32, bfloat16 or float16),
        else float8 weights come back dequantized in fp32, others in their stored dtype. A value
        that is not finite in that dtype is a ValueError naming the tensor, file and element."""
        if dtype is not None and dtype not in READ_DTYPES:
            raise ValueError(f"tensor {name}: a checkpoint is read into {list(READ_DTYPES)}, not {dtype}")
        tensor_slice, file = self._slice(name)
        stored = tuple(tensor_slice.get_shape())
        if stored != tuple(shape):
            raise ValueError(f"tensor {name} in {self.folder / file} has shape {list(stored)}; the config "
                             f"({self.folder / 'config.json'}) gives {list(shape)}")
        index = self._index(len(shape), dim, start, stop)
        stored_dtype = tensor_slice.get_dtype()
        if stored_dtype == "F8_E4M3":
            return self._dequantize(name, file, tensor_slice[index], shape, dim, start, stop, dtype or torch.float32)
        if stored_dtype not in FLOAT_DTYPES:
            raise ValueError(f"tensor {name} in {self.folder / file} is {stored_dtype}; supported: "
                             f"{', '.join(FLOAT_DTYPES)} and F8_E4M3 with a weight_scale_inv")
        # A slice is a view of the file's mapping: copy it, so that the model owns its weights
        # and keeps no checkpoint file mapped.
        values = tensor_slice[index]
        return self._checked_copy(name, file, values, dtype or values.dtype, lambda rows: values[rows], dim, start)

    def _checked_copy(self, name: str, file: str, values: torch.Tensor, dtype: torch.dtype, rows_of, dim: int | None,
                      start: int) -> torch.Tensor:
        """A new contiguous tensor of `dtype` shaped like `values`, written chunk by chunk from
        rows_of(rows), rows a slice of dim 0; each chunk is checked for finiteness right after it
        is written (module docstring). `dim` and `start` place the slice in the whole tensor."""
        out = torch.empty(values.shape, dtype=dtype)
        if out.numel() == 0:
            return out
        row_bytes = out[0].numel() * out.element_size() if out.dim() > 1 else out.element_size()
        step = max(1, CHUNK_BYTES // row_bytes)
        for first in range(0, out.shape[0], step):
            rows = slice(first, first + step)
            chunk = out[rows]
            chunk.copy_(rows_of(rows))
            if not math.isfinite(chunk.sum(dtype=torch.float32)) and not bool(torch.isfinite(chunk).all()):
                raise self._not_finite(name, file, chunk, rows_of(rows), first, dim, start)
        return out

    def _not_finite(self, name, file, chunk, source, first_row, dim, start) -> ValueError:
        """The error for the first element of `chunk` that is not finite (`source`: its values
        before the conversion into chunk's dtype)."""
        element = [int(i) for i in (~torch.isfinite(chunk)).nonzero()[0]]
        value = source[tuple(element)].item()
        element[0] += first_row
        if dim is not None:
            element[dim] += start
        where = f"tensor {name} in {self.folder / file} is not finite"
        if not math.isfinite(value):
            return ValueError(f"{where}: element {element} is {value}")
        return ValueError(f"{where} in {chunk.dtype}, the model's dtype: element {element} is {value}, beyond its range")

    @staticmethod
    def _index(ndim: int, dim: int | None, start: int, stop: int | None) -> tuple[slice, ...]:
        index = [slice(None)] * ndim
        if dim is not None:
            index[dim] = slice(start, stop)
        return tuple(index)

    def _dequantize(self, name, file, values, shape, dim, start, stop, dtype) -> torch.Tensor:
        if len(shape) != 2:
            raise ValueError(f"tensor {name} in {self.folder / file} is float8 with {len(shape)} dims; block "
                             "quantization covers matrices")
        scale_name = f"{name}_scale_inv"
        if scale_name not in self.weight_map:
            raise ValueError(f"tensor {name} in {self.folder / file} is float8 but the checkpoint has no {scale_name}")
        blocks = tuple(math.ceil(n / b) for n, b in zip(shape, self.fp8_block))
        stop = shape[dim] if dim is not None and stop is None else stop
        first_block = start // self.fp8_block[dim] if dim is not None else 0
        scale_stop = math.ceil(stop / self.fp8_block[dim]) if dim is not None else None
        scales = self.read(scale_name, blocks, dim, first_block, scale_stop).float()
        for axis, block in enumerate(self.fp8_block):
            scales = scales.repeat_interleave(block, dim=axis)
        offset = first_block * self.fp8_block[dim] if dim is not None else 0
        rows = [slice(0, values.shape[0]), slice(0, values.shape[1])]
        if dim is not None:
            rows[dim] = slice(start - offset, stop - offset)
        scales = scales[tuple(rows)]
        return self._checked_copy(name, file, values, dtype, lambda part: values[part].float() * scales[part], dim, start)
