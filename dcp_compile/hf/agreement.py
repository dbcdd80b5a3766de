"""The ranks of a DCP group run one sequence: one step, with the same tokens, on every rank.

Under DCP each rank writes its shard of every token's KV, so a rank that feeds a different token
(its own sample), a different batch or a cache at other KV locations corrupts the group's cache
without an error: the shards no longer belong to one sequence. The guarantees, for a group of
more than one rank:

- `shared_generators()`, around a sampling `generate()`: every rank samples with the group's first
  rank's random generators (its state is broadcast), so with the same logits every rank draws the
  first rank's token, the one transformers draws with the first rank's seed. This is the
  synchronised seed engines use (SGLang samples on every TP rank and makes the tokens agree). The
  other ranks' generators are restored afterwards, so a per-rank seed still serves the rank's own
  work.
- `check_step()`, at every step before anything runs: one all-gather of a few ints per step (the
  input's shape, the cache's rows, width, length and a checksum of its KV locations, a checksum of
  the token ids and the attention mask's padding, and whether this rank refused the step's input).
  Ranks that differ (other shapes, another cache position or cache, other tokens: a sample drawn
  apart, prompts of other lengths) get the same ValueError on every rank, naming what each was
  given; an input one rank refuses is refused on every rank. Both are agreed errors: the model
  serves the next call (runtime/failure.py). Inside generate() on a device a decode step agrees
  without a host sync (`deferred`): the all-gather and the comparison run on the device, and a
  difference sets the device error flag `peer_step` (runtime/guards.py), raised at the next step.
  `check_generate()` does the same for a generate() call (its prompt, length and decoding) before
  the generators are shared, and `check_result()` for the tokens it returns (a logits processor
  that differs by rank changes the last token, which no step reads).
- `same_free()` and `common_free()`: a cache takes the same KV locations on every rank, whatever
  each rank's garbage collector has given back (hf/locations.py).
- `tell_failure()`: a rank whose step failed after the step's collectives tells its peers at its
  next agreement; every rank then latches (runtime/failure.py).

Every host agreement is one all-gather of VECTOR int64s, whatever its kind, so that ranks in
different agreements (a rank in generate() and a peer in a step, a failure notice) pair their
collectives and get an error, never a collective mismatch.
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib

import torch
import torch.distributed as dist

from dcp_compile.hf.cache import DCPCache
from dcp_compile.runtime import guards
from dcp_compile.runtime.failure import PeerFailedError, agreed

CHECKSUM_PRIME = (1 << 31) - 1
"""The token checksum is sum_i ((id_i mod p) * (i + 1) mod p): a single differing token, or two
swapped, always changes it (p is prime), and no product overflows int64."""
STEP_FIELDS = ("batch", "tokens", "token ids given", "integer token ids", "cache rows", "cache width",
               "cached positions", "cache locations", "token checksum")
GENERATE_FIELDS = ("batch", "prompt tokens", "generated length", "num_return_sequences", "num_beams", "sampling",
                   "guidance", "use_cache", "assisted", "prompt checksum")
"""assisted: prompt_lookup_num_tokens, -1 with an assistant model, 0 without assistance."""
ALLOCATION_FIELDS = ("locations", "free locations")
RESULT_FIELDS = ("rows", "tokens", "token checksum")
STEP, GENERATE, DECODE_STEP, ALLOCATION, RESULT, FAILURE = range(6)
KINDS = ("a model step", "generate()", "a decode step of generate()", "a cache's allocation", "generate()'s result",
         "a failure notice")
"""What a rank was in when it joined an agreement: the first int of every rank's vector, so that a
rank in generate() and a peer in a step get an error, not each other's fields."""
FIELDS = {STEP: STEP_FIELDS, GENERATE: GENERATE_FIELDS, ALLOCATION: ALLOCATION_FIELDS, RESULT: RESULT_FIELDS}
HEADER = 2
"""[kind, refusal]: refusal is 0, or a nonzero code of the error this rank refused its input with."""
VECTOR = HEADER + max(len(fields) for fields in FIELDS.values())
_SHARING_RANKS: contextvars.ContextVar[frozenset] = contextvars.ContextVar("dcp_sharing_ranks", default=frozenset())
"""The global ranks whose random generators are the first one's, inside shared_generators()."""
RULE = ("Every rank of a DCP group must run the same step with the same batch: the same input shapes, cache, cache "
        "position and token ids (the same generate() call)")


def _code(value) -> int:
    """A nonzero int63 of `value`'s text (a refusal's, a free list's)."""
    return (zlib.crc32(repr(value).encode()) << 1) | 1


def _step_fields(inputs: torch.Tensor, input_ids: torch.Tensor | None, cache) -> list[int]:
    rows, width, length = (-1, -1, -1)
    if isinstance(cache, DCPCache):
        rows, width, length = cache.rows, cache.max_length, cache.length()
    return [inputs.shape[0], inputs.shape[1] if inputs.dim() > 1 else -1, int(input_ids is not None),
            int(input_ids is not None and not input_ids.is_floating_point() and input_ids.dtype != torch.bool),
            rows, width, length, cache.locations_code if isinstance(cache, DCPCache) else -1]


def _device_checksum(input_ids: torch.Tensor) -> torch.Tensor:
    """The checksum as a 0-d int64 tensor on input_ids' device (no read-back)."""
    ids = input_ids.reshape(-1).to(torch.int64).remainder(CHECKSUM_PRIME)
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64, device=ids.device)
    return (ids * weights).remainder(CHECKSUM_PRIME).sum()


def _checksum(input_ids: torch.Tensor | None) -> int:
    if input_ids is None or not input_ids.numel():
        return 0
    return int(_device_checksum(input_ids))


class GroupAgreement:
    """The DCP group of one model (`group_name`, this rank `dcp_rank` of `dcp_size`), whose
    collectives take tensors on `device` (the KV pool's)."""

    def __init__(self, dcp_size: int, dcp_rank: int, group_name: str | None, device: torch.device):
        self.dcp_size, self.dcp_rank, self.group_name, self.device = dcp_size, dcp_rank, group_name, device

    def _group(self):
        return dist.distributed_c10d._resolve_process_group(self.group_name)

    def check_step(self, inputs: torch.Tensor | None, input_ids: torch.Tensor | None, cache,
                   attention_mask: torch.Tensor | None = None, deferred: bool = False,
                   refusal: BaseException | None = None) -> None:
        """Raise the same ValueError on every rank unless every rank of the group was given this
        step's shapes, cache, cache position and token ids (and padding, where a mask is given).
        `inputs`: input_ids, or inputs_embeds. refusal: the error this rank's own checks raised
        for the step's input (raised here, on every rank alike: the peers name the rank).
        deferred (a decode step inside generate() on a device): nothing is read back; a
        difference sets the device flag `peer_step`, which the compiled step raises at the next
        step. A rank that refuses a deferred step agrees on the host: its peers, on the device,
        go on into the step, so its refusal latches unless every rank refused alike."""
        if self.dcp_size == 1:
            if refusal is not None:
                raise agreed(refusal)
            return
        if refusal is not None:
            self._agree(STEP, [], refusal)
        elif deferred and self.device.type != "cpu":
            self._agree_on_device(_step_fields(inputs, input_ids, cache), input_ids, attention_mask)
        else:
            checksum = _checksum(input_ids)
            if attention_mask is not None:
                checksum = (checksum + 2 * _checksum(attention_mask.bool())) % CHECKSUM_PRIME
            self._agree(STEP, _step_fields(inputs, input_ids, cache) + [checksum])

    def check_generate(self, input_ids: torch.Tensor | None, generated_length: int, settings: dict[str, int],
                       refusal: BaseException | None = None) -> None:
        """Raise the same ValueError on every rank unless every rank's generate() call agrees (its
        prompt, length and `settings`, GENERATE_FIELDS' ints by name), before anything of it runs;
        refusal: this rank's own error for the call (raised on every rank alike)."""
        if self.dcp_size == 1:
            if refusal is not None:
                raise agreed(refusal)
            return
        if refusal is not None:
            self._agree(GENERATE, [], refusal)
        else:
            self._agree(GENERATE, [input_ids.shape[0], input_ids.shape[-1], generated_length]
                        + [settings[name] for name in GENERATE_FIELDS[3:-1]] + [_checksum(input_ids)])

    def check_result(self, sequences: torch.Tensor) -> None:
        """Raise the same ValueError on every rank unless every rank's generate() returned these tokens."""
        if self.dcp_size > 1:
            self._agree(RESULT, [sequences.shape[0], sequences.shape[-1], _checksum(sequences)])

    def same_free(self, count: int, free: list) -> bool:
        """Whether every rank asks for `count` locations with the same free list (ranges); a
        ValueError on every rank where the counts differ."""
        rows = self._agree(ALLOCATION, [count, _code(free)], differing_ok=(1,))
        return all(row[1] == rows[0][1] for row in rows)

    def fewest_free(self, free: int) -> int:
        """The fewest free locations of any rank (`free`: this rank's)."""
        return min(row[1] for row in self._agree(ALLOCATION, [0, free], differing_ok=(1,)))

    def common_free(self, free_pages: torch.Tensor) -> torch.Tensor:
        """The pages (a bool [pages] mask) free on every rank of the group."""
        mine = free_pages.to(torch.uint8).to(self.device)
        gathered = torch.empty(self.dcp_size * mine.numel(), dtype=torch.uint8, device=self.device)
        dist.all_gather_into_tensor(gathered, mine, group=self._group())
        return gathered.view(self.dcp_size, -1).all(dim=0).cpu()

    def tell_failure(self, failure: str) -> None:
        """Tell the peers, at their agreement, that a step of this rank failed (they latch)."""
        if self.dcp_size > 1:
            self._agree(FAILURE, [])

    def _agree_on_device(self, values: list[int], input_ids: torch.Tensor | None,
                         attention_mask: torch.Tensor | None) -> None:
        """check_step's agreement with no host sync: [kind, 0, a hash of the host fields, the
        token checksum, the mask's] made on the device (fills and the checksums' kernels, no copy
        from the host), all-gathered, compared there into the `peer_step` error flag. Its vector
        is VECTOR ints, as _agree's, so a peer in another kind of agreement fails it too."""
        vector = torch.zeros(VECTOR, dtype=torch.int64, device=self.device)
        vector[0] = DECODE_STEP
        vector[HEADER] = hash(tuple(values)) & ((1 << 62) - 1)
        if input_ids is not None and input_ids.numel():
            vector[HEADER + 1] = _device_checksum(input_ids)
        if attention_mask is not None and attention_mask.numel():
            vector[HEADER + 2] = _device_checksum(attention_mask.bool())
        gathered = torch.empty(self.dcp_size * VECTOR, dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(gathered, vector, group=self._group())
        per_rank = gathered.view(self.dcp_size, VECTOR)
        differs = (per_rank != per_rank[:1]).any()
        flags = guards.error_flags(self.device)
        flags[guards.INDEX["peer_step"]] |= differs.to(flags.dtype)

    def _agree(self, kind: int, values: list[int], refusal: BaseException | None = None,
               differing_ok: tuple[int, ...] = ()) -> list[list[int]]:
        """One all-gather of [kind, refusal code, values..] (VECTOR ints) over the group. Raises,
        on every rank alike: this rank's refusal or a peer's; a ValueError naming what differs
        (but for the fields at `differing_ok`, indices of values). Raises PeerFailedError (not
        agreed: it latches) where a peer tells of a failure. Returns every rank's values."""
        vector = torch.zeros(VECTOR, dtype=torch.int64)
        vector[:HEADER + len(values)] = torch.tensor([kind, 0 if refusal is None else _code(str(refusal))] + values,
                                                     dtype=torch.int64)
        vector = vector.to(self.device)
        gathered = torch.empty(self.dcp_size * VECTOR, dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(gathered, vector, group=self._group())
        per_rank = gathered.view(self.dcp_size, VECTOR).tolist()
        if kind == FAILURE:
            return []
        failed = [rank for rank, row in enumerate(per_rank) if row[0] == FAILURE]
        if failed:
            raise PeerFailedError(failed[0])
        if refusal is not None:
            # Peers in a deferred decode step went on into the step: only a refusal every rank
            # made alike is agreed.
            raise agreed(refusal) if all(row[0] != DECODE_STEP for row in per_rank) else refusal
        refused = [rank for rank, row in enumerate(per_rank) if row[1]]
        if refused:
            raise agreed(ValueError(f"DCP rank {refused[0]} refused this step's input (its own error names the cause), "
                                    f"so every rank refuses it. {RULE}"))
        if len({row[0] for row in per_rank}) > 1:
            given = "; ".join(f"rank {rank} in {KINDS[row[0]]}" for rank, row in enumerate(per_rank))
            raise agreed(ValueError(f"the DCP ranks were given different steps: {given}. {RULE}"))
        names = FIELDS[kind]
        differing = [i for i, _ in enumerate(names) if len({row[HEADER + i] for row in per_rank}) > 1]
        if all(i in differing_ok for i in differing):
            return [row[HEADER:HEADER + len(names)] for row in per_rank]
        if len(differing) > 1:  # other shapes or positions: the checksum differs with them
            differing = differing[:-1] if differing[-1] == len(names) - 1 else differing
        given = "; ".join(f"rank {rank}: " + ", ".join(f"{names[i]} {row[HEADER + i]}" for i in differing)
                          for rank, row in enumerate(per_rank))
        raise agreed(ValueError(f"the DCP ranks were given different {self._what(kind, names[differing[-1]])}: "
                                f"{given}. {RULE}"))

    @staticmethod
    def _what(kind: int, field: str) -> str:
        if kind == RESULT:
            return ("tokens from generate() (a logits processor, stopping criterion or streamer that differs by rank? "
                    "the last token is sampled after the last step, and no step reads it)")
        if kind == ALLOCATION:
            return "caches (every rank makes the same caches, in the same order)"
        if kind == STEP and field == "token checksum":
            return ("steps (the token ids differ: a token sampled apart on each rank? generate() samples with the "
                    "group's first rank's generator; a loop of your own must sample on one rank and broadcast the "
                    "token)")
        if kind == STEP and field == "cache locations":
            return "steps (their caches sit at other KV locations: make caches with model.new_cache on every rank alike)"
        return "steps" if kind == STEP else "generate() calls"

    @contextlib.contextmanager
    def shared_generators(self, device: torch.device):
        """Every rank of the group samples with the first rank's random generators (the CPU's,
        and `device`'s) inside the block; afterwards the other ranks' own are restored. Inside
        such a block of a group holding these ranks (a DCP assistant model's generate() within its
        target's) the generators are shared already, and the block leaves them as they are: a
        restore there would put back the state from before the assistant drew its tokens on every
        rank but the first."""
        if self.dcp_size == 1:
            yield
            return
        group = self._group()
        ranks = frozenset(dist.get_process_group_ranks(group))
        if ranks <= _SHARING_RANKS.get():
            yield
            return
        generators = [(torch.get_rng_state, torch.set_rng_state)]
        if device.type != "cpu":
            module = torch.get_device_module(device)
            generators.append((lambda: module.get_rng_state(device), lambda state: module.set_rng_state(state, device)))
        own = [get() for get, _ in generators]
        for (_, set_state), state in zip(generators, own):
            shared = state.to(self.device, copy=True)
            dist.broadcast(shared, group=group, group_src=0)
            set_state(shared.cpu())
        sharing = _SHARING_RANKS.set(ranks)
        try:
            yield
        finally:
            _SHARING_RANKS.reset(sharing)
            if self.dcp_rank != 0:
                for (_, set_state), state in zip(generators, own):
                    set_state(state)
