"""The checks of the native KV write, `torch_npu.npu_scatter_pa_kv_cache`, against its contract
(op-plugin's doc of the op: docs/ascend.md §17, §20.2), not against the lowering's code of the day:
key [T, 1, 512] and value [T, 1, 64] into the layer's latent and rope caches, ND ('Norm',
[blocks, block, 1, D]) or NZ ('PA_NZ', [blocks, D/16, block, 16]); slot s is row s % block of
block s // block. Each check starts from random caches and reads every row back."""

from __future__ import annotations

import torch

from dcp_compile.doctor.npu.attention import LATENT, ROPE
from dcp_compile.doctor.npu.checks import Context, Result, first_line
from dcp_compile.ops import nz

BLOCK = nz.BLOCK
MODES = {"nd": "Norm", "nz": "PA_NZ"}
UNSAFE_WITHOUT = {"nd": "npu_kernels='native'", "nz": "npu_kv_format='nz'"}
"""What a failed write of each layout makes unsafe: the native write itself (ND, the default
layout), or the NZ cache only."""


def _device_cache(rows: torch.Tensor, kv_format: str, device) -> torch.Tensor:
    """[rows, D] as the op's 4-D cache on the device."""
    if kv_format == "nd":
        return rows.view(-1, BLOCK, 1, rows.shape[-1]).to(device)
    nz_rows = nz.from_rows(rows, BLOCK)  # [blocks, 1, D/16, block, 16]
    return nz_rows.view(nz_rows.shape[0], nz_rows.shape[2], BLOCK, nz.GROUP).to(device)


def _host_rows(cache: torch.Tensor, kv_format: str) -> torch.Tensor:
    """The op's 4-D cache back as [rows, D] on the host."""
    cache = cache.cpu()
    if kv_format == "nd":
        return cache.reshape(-1, cache.shape[-1])
    return nz.to_rows(cache.unsqueeze(1))


def write(kv_format: str, blocks: int, slots: list[int], slot_dtype=torch.int32, seed: int = 0, device=None):
    """One npu_scatter_pa_kv_cache call of len(slots) tokens into random caches of `blocks` blocks:
    (the caches' rows before, the tokens' rows, the caches' rows after), each a (latent, rope)
    pair on the host."""
    generator = torch.Generator().manual_seed(seed)
    before = [torch.randn(blocks * BLOCK, width, generator=generator).bfloat16() for width in (LATENT, ROPE)]
    tokens = [torch.randn(len(slots), width, generator=generator).bfloat16() for width in (LATENT, ROPE)]
    caches = [_device_cache(part, kv_format, device) for part in before]
    torch.ops.npu.npu_scatter_pa_kv_cache(tokens[0].view(-1, 1, LATENT).to(device), tokens[1].view(-1, 1, ROPE).to(device),
                                          *caches, torch.tensor(slots, dtype=slot_dtype).to(device),
                                          cache_mode=MODES[kv_format])
    return before, tokens, [_host_rows(cache, kv_format) for cache in caches]


def wrong_rows(before, tokens, after, slots, skip=()) -> list[int]:
    """The rows (outside `skip`) that differ from what the contract gives: each slot's token, every
    other row unchanged."""
    wrong = set()
    for part_before, part_tokens, part_after in zip(before, tokens, after):
        want = part_before.clone()
        for token, slot in enumerate(slots):
            if slot not in skip:
                want[slot] = part_tokens[token]
        differs = (want != part_after).any(dim=-1)
        wrong.update(int(row) for row in differs.nonzero().flatten() if int(row) not in skip)
    return sorted(wrong)


def check_int32_slots(result: Result, context: Context) -> None:
    """Distinct slots spread over three blocks, written ND ('Norm') with an int32 slot_mapping: every
    row lands at its slot and no other row changes. The same write with int64 slots is measured
    too: the 2025 A2/A3 ND kernel reads the slots as int32 words whatever their dtype, so int64
    slots land token i at the i-th 32-bit word (docs/ascend.md §20.2)."""
    slots = [5, 130, 257, 3, 200, 99, 1, 383]
    rows = {}
    for dtype in (torch.int32, torch.int64):
        name = str(dtype).removeprefix("torch.")
        try:
            before, tokens, after = write("nd", 3, slots, dtype, seed=51, device=context.device)
            rows[name] = wrong_rows(before, tokens, after, slots)
        except Exception as exc:
            rows[name] = first_line(exc)
    result.measured = {f"{name}_rows_wrong": found for name, found in rows.items()}
    result.verdict = "PASS" if rows["int32"] == [] else "FAIL"
    if rows["int64"] != [] and rows["int32"] == []:
        result.detail = "int64 slots are misread here: only an int32 slot_mapping is safe (the native write's)"


def check_pa_nz(result: Result, context: Context) -> None:
    """'PA_NZ' into NZ caches [blocks, D/16, 128, 16]: channel d of slot s lands at
    [s // 128, d // 16, s % 128, d % 16], the layout FIA reads (docs/ascend.md §15.1). A kernel
    without PA_NZ (Ascend950 before CANN's arch35 PA_NZ) refuses the call or writes ND order."""
    slots = [3, 130, 255, 0, 64]
    try:
        before, tokens, after = write("nz", 2, slots, seed=52, device=context.device)
    except Exception as exc:
        result.verdict, result.detail = "FAIL", f"'PA_NZ' refused: {first_line(exc)}"
        return
    wrong = wrong_rows(before, tokens, after, slots)
    result.measured = {"rows_wrong": wrong, "rows_written": len(slots)}
    result.verdict = "PASS" if not wrong else "FAIL"


def check_dummy_slot(result: Result, context: Context) -> None:
    """Tokens another rank owns and padded rows write one valid reserved slot (the native write's
    scheme: the first row of a reserved block past the locations' rows; SGLang's NPU pool writes
    padding to slot 0): only that slot may change. Measured for the first slot, the first of the
    last block and the last slot, ND and NZ, with one token there and with four (a step has many
    tokens this rank does not own: the doc leaves repeated slots' result undefined, which must stay
    confined to that slot)."""
    owned = [7, 130, 200, 254]
    failed, repeats_refused = set(), set()
    for kv_format in MODES:
        for dummy in (0, BLOCK, 2 * BLOCK - 1):
            for copies in (1, 4):
                slots = owned[:2] + [dummy] * copies + owned[2:]
                key = f"{kv_format}_slot{dummy}_x{copies}"
                try:
                    before, tokens, after = write(kv_format, 2, slots, seed=53, device=context.device)
                except Exception as exc:
                    result.measured[key] = first_line(exc)
                    (failed if copies == 1 else repeats_refused).add(kv_format)
                    continue
                result.measured[key] = wrong_rows(before, tokens, after, slots, skip=(dummy,))
                if result.measured[key]:
                    failed.add(kv_format)
    if repeats_refused and not failed and context.emulated:
        result.detail = ("the stand-in refuses repeated slots (the op's doc leaves their result undefined), so the "
                         "emulator cannot say what a kernel writes then; a write to one dummy slot changes only it")
        return
    failed |= repeats_refused
    result.verdict = "FAIL" if failed else "PASS"
    result.unsafe = [UNSAFE_WITHOUT[kv_format] for kv_format in MODES if kv_format in failed]
    if repeats_refused:
        result.detail = "this kernel refuses repeated slots, which the native write sends for the tokens it does not own"


def check_native_kv_write(result: Result, context: Context) -> None:
    """The native lowering's KV write as a step issues it (dcp_npu.slot_mapping, then
    dcp_npu.scatter_kv_cache over a layer's two parts with the reserved block past the locations'
    rows) against reference.kv_write, ND and NZ, on ranks 0 and 1 of 2: a short step with padding,
    and a step of more tokens than the cache has slots (every location, and padding)."""
    from dcp_compile.lowering.npu import native_ops
    from dcp_compile.ops import reference

    device = context.device
    generator = torch.Generator().manual_seed(54)
    rows = 4 * BLOCK
    steps = {"short": torch.tensor([0, 3, 130, 131, 257, 0, 300, 501]),
             "long": torch.cat([torch.arange(1, 2 * rows), torch.zeros(7, dtype=torch.int64)])}
    failed = set()
    for name, loc in steps.items():
        latent = torch.randn(loc.shape[0], LATENT, generator=generator).bfloat16()
        rope = torch.randn(loc.shape[0], ROPE, generator=generator).bfloat16()
        for kv_format in MODES:
            for rank in range(2):
                parts = [torch.randn(rows + BLOCK, width, generator=generator).bfloat16() for width in (LATENT, ROPE)]
                want = [part[:rows].clone() for part in parts]
                reference.kv_write(want[0], latent, rope, loc, rank, 2, 1, rope_cache=want[1])
                got = [(nz.from_rows(part, BLOCK) if kv_format == "nz" else part).to(device) for part in parts]
                slots = native_ops.SLOT_MAPPING(loc.to(device), rows, rank, 2, 1)
                native_ops.SCATTER_KV_CACHE(got[0], latent.to(device), rope.to(device), slots, BLOCK, got[1])
                written = [(nz.to_rows(part.cpu()) if kv_format == "nz" else part.cpu())[:rows] for part in got]
                same = all(torch.equal(g, w) for g, w in zip(written, want))
                result.measured[f"{name}_{kv_format}_rank{rank}"] = same
                if not same:
                    failed.add(kv_format)
    result.verdict = "FAIL" if failed else "PASS"
    result.unsafe = [UNSAFE_WITHOUT[kv_format] for kv_format in MODES if kv_format in failed]
