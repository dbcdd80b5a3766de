"""The one place that knows how logical KV locations map onto DCP ranks.

N = dcp_size, r = dcp_rank, I = interleave size.
  owner(loc) = (loc // I) % N
  local(loc) = (loc // (I*N)) * I + loc % I
Location 0 is reserved for padding writes: it is never written and never read.
Every function works on Python ints and on integer tensors alike.
"""

from __future__ import annotations

import torch

PADDING_LOC = 0


def owner(loc, dcp_size: int, interleave: int = 1):
    return (loc // interleave) % dcp_size


def local_row(loc, dcp_size: int, interleave: int = 1):
    return (loc // (interleave * dcp_size)) * interleave + loc % interleave


def global_loc(row, dcp_rank: int, dcp_size: int, interleave: int = 1):
    """Inverse of (owner, local_row): the logical location stored at `row` of rank `dcp_rank`."""
    return (row // interleave) * interleave * dcp_size + dcp_rank * interleave + row % interleave


def rows_per_rank(capacity: int, dcp_size: int, interleave: int = 1) -> int:
    """Physical rows a rank needs so that every location in [0, capacity) has a row."""
    stride = interleave * dcp_size
    return -(-capacity // stride) * interleave


def logical_capacity(rows: int, dcp_size: int, interleave: int = 1) -> int:
    """Largest logical capacity whose every location fits in `rows` rows per rank."""
    return (rows // interleave) * interleave * dcp_size


def validate(dcp_size: int, dcp_rank: int, interleave: int) -> None:
    if dcp_size < 1:
        raise ValueError(f"dcp_size must be >= 1, got {dcp_size}")
    if not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank must be in [0, {dcp_size}), got {dcp_rank}")
    if interleave < 1:
        raise ValueError(f"interleave must be >= 1, got {interleave}")


def local_block_size(page_size: int, dcp_size: int, interleave: int = 1) -> int | None:
    """Rows one logical page puts on a rank as one whole local block, or None where a page's
    rows do not form whole, aligned local blocks (a paged kernel cannot then
    read the shard through a block table).

    - I*N divides the page size: every rank holds page_size / N consecutive local rows of the
      page, local block p (the page id).
    - I == page size: the whole page lives on rank p % N, as local block p // N.
    """
    if page_size % (interleave * dcp_size) == 0:
        return page_size // dcp_size
    if interleave == page_size:
        return page_size
    return None


def require_local_block_size(page_size: int, dcp_size: int, interleave: int, reader: str) -> int:
    """local_block_size, or a ValueError saying that `reader` (a paged kernel) cannot read the shard."""
    block_size = local_block_size(page_size, dcp_size, interleave)
    if block_size is None:
        raise ValueError(
            f"{reader} reads each rank's KV as whole local blocks: page size {page_size} with interleave {interleave} "
            f"over dcp_size {dcp_size} does not map onto them. Use a page size that is a multiple of interleave x "
            "dcp_size (block_size x dcp_size at interleave 1), or interleave == page size"
        )
    return block_size


def local_blocks_of_page(page: int, page_size: int, dcp_size: int, interleave: int = 1) -> list[tuple[int, int]]:
    """(rank, local block id) for each rank that holds rows of logical page `page`."""
    if page_size % (interleave * dcp_size) == 0:
        return [(rank, page) for rank in range(dcp_size)]
    if interleave == page_size:
        return [(page % dcp_size, page // dcp_size)]
    raise ValueError(
        f"page size {page_size} with interleave {interleave} over dcp_size {dcp_size} does not map pages "
        f"onto whole local blocks: use a page size that is a multiple of interleave x dcp_size, or interleave == page size"
    )


def local_view(req_to_token, seq_lens, dcp_rank: int, dcp_size: int, interleave: int):
    """A rank's local view of each request: local rows and global positions, in position order.

    Returns (local_req_to_token [B, L], local_seq_lens [B], local_positions [B, L]); entries past
    local_seq_lens[b] are 0 and never read. L stays the global width so shapes are static.
    """
    width = req_to_token.shape[1]
    positions = torch.arange(width, device=req_to_token.device)
    valid = positions[None, :] < seq_lens[:, None].to(positions.dtype)
    owned = valid & (owner(req_to_token, dcp_size, interleave) == dcp_rank)
    local_seq_lens = owned.sum(dim=1).to(seq_lens.dtype)
    # A stable sort on "not owned" moves owned entries to the front and keeps their order.
    order = torch.sort((~owned).to(torch.int8), dim=1, stable=True).indices
    kept = torch.gather(owned, 1, order)
    local_rows = local_row(torch.gather(req_to_token, 1, order), dcp_size, interleave)
    local_req_to_token = torch.where(kept, local_rows, 0).to(req_to_token.dtype)
    local_positions = torch.where(kept, order, 0).to(req_to_token.dtype)
    return local_req_to_token, local_seq_lens, local_positions
