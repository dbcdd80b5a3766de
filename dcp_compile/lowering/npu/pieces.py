"""A batch cut into pieces of at most WINDOW_QUERIES consecutive query tokens of one row: the rows
FIA's MLA path runs, which takes at most 16 queries a request (docs/ascend.md §4.3), so that the
native lowering serves chunks of any length (lower_attention.py; docs/paged-lowerings.md)."""

from __future__ import annotations

import itertools

from dcp_compile.ops.targets import WINDOW_QUERIES
from dcp_compile.runtime.host_metadata import RankHostMetadata


def pieces(host: RankHostMetadata) -> list[tuple[int, int, int]]:
    """(row, first token, tokens) per piece, in token order."""
    found, first = [], 0
    for row, count in enumerate(host.query_lens):
        found.extend((row, first + start, min(WINDOW_QUERIES, count - start)) for start in range(0, count, WINDOW_QUERIES))
        first += count
    return found


def piece_prefix_lens(host: RankHostMetadata, cut: list[tuple[int, int, int]] | None = None) -> list[int]:
    """Per piece, this rank's keys of its row before the piece's first query: the row's keys before
    the step, and the step's earlier tokens of the row this rank stores (host.query_owned). `cut`:
    pieces(host), where the caller has it already."""
    row_first = list(itertools.accumulate((0,) + host.query_lens[:-1]))
    owned = None if host.query_owned is None else [0, *itertools.accumulate(map(int, host.query_owned))]
    prefix = []
    for row, first, _ in pieces(host) if cut is None else cut:
        before = 0
        if first > row_first[row]:
            if owned is None:
                raise ValueError(f"host metadata without query owners serves rows of at most {WINDOW_QUERIES} "
                                 f"queries; row {row} has {host.query_lens[row]}")
            before = owned[first] - owned[row_first[row]]
        prefix.append(host.local_prefix_lens[row] + before)
    return prefix
