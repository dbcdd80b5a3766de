"""The ranks of a DCP group run one sequence: one step, with the same tokens, on every rank.

Under DCP each rank writes its shard of every token's KV, so a rank that feeds a different token
(its own sample) or a different batch corrupts the group's cache without an error: the shards no
longer belong to one sequence. Two guarantees, for a group of more than one rank:

- `shared_generators()`, around a sampling `generate()`: every rank samples with the group's first
  rank's random generators (its state is broadcast), so with the same logits every rank draws the
  first rank's token, the one transformers draws with the first rank's seed. This is the
  synchronised seed engines use (SGLang samples on every TP rank and makes the tokens agree). The
  other ranks' generators are restored afterwards, so a per-rank seed still serves the rank's own
  work.
- `check_step()`, at every step before anything runs: one all-gather of a few ints per step (the
  input's shape, the cache's rows, width and length, and a checksum of the token ids and the
  attention mask's padding). Ranks that
  differ (other shapes, another cache position, other tokens: a sample drawn apart, prompts of
  other lengths) get the same ValueError on every rank, naming what each was given. Inside
  generate() on a device a decode step agrees without a host sync (`deferred`): the all-gather
  and the comparison run on the device, and a difference sets the device error flag
  `peer_step` (runtime/guards.py), raised at the next step on every rank alike.
  `check_generate()` does the same for a generate() call (its prompt, length and decoding) before
  the generators are shared, so a rank that samples and a peer that does not get that error,
  not mismatched collectives.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from dcp_compile.hf.cache import DCPCache
from dcp_compile.runtime import guards

CHECKSUM_PRIME = (1 << 31) - 1
"""The token checksum is sum_i ((id_i mod p) * (i + 1) mod p): a single differing token, or two
swapped, always changes it (p is prime), and no product overflows int64."""
STEP_FIELDS = ("batch", "tokens", "token ids given", "integer token ids", "cache rows", "cache width",
               "cached positions", "token checksum")
GENERATE_FIELDS = ("batch", "prompt tokens", "generated length", "num_return_sequences", "num_beams", "sampling",
                   "guidance", "use_cache", "prompt checksum")
KINDS = ("a model step", "generate()", "a decode step of generate()")
"""What a rank was in when it joined an agreement: the first int of every rank's vector, so that a
rank in generate() and a peer in a step get an error, not each other's fields."""
VECTOR = 1 + max(len(STEP_FIELDS), len(GENERATE_FIELDS))


def _step_fields(inputs: torch.Tensor, input_ids: torch.Tensor | None, cache) -> list[int]:
    rows, width, length = (-1, -1, -1)
    if isinstance(cache, DCPCache):
        rows, width, length = cache.rows, cache.max_length, cache.length()
    return [inputs.shape[0], inputs.shape[1] if inputs.dim() > 1 else -1, int(input_ids is not None),
            int(input_ids is not None and not input_ids.is_floating_point() and input_ids.dtype != torch.bool),
            rows, width, length]


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

    def check_step(self, inputs: torch.Tensor, input_ids: torch.Tensor | None, cache,
                   attention_mask: torch.Tensor | None = None, deferred: bool = False) -> None:
        """Raise the same ValueError on every rank unless every rank of the group was given this
        step's shapes, cache position and token ids (and padding, where a mask is given).
        `inputs`: input_ids, or inputs_embeds. deferred (a decode step inside generate() on a
        device): nothing is read back; a difference sets the device flag `peer_step`, which the
        compiled step raises at the next step."""
        if self.dcp_size > 1 and deferred and self.device.type != "cpu":
            self._agree_on_device(_step_fields(inputs, input_ids, cache), input_ids, attention_mask)
        elif self.dcp_size > 1:
            checksum = _checksum(input_ids)
            if attention_mask is not None:
                checksum = (checksum + 2 * _checksum(attention_mask.bool())) % CHECKSUM_PRIME
            self._agree(0, _step_fields(inputs, input_ids, cache) + [checksum])

    def check_generate(self, input_ids: torch.Tensor, generated_length: int, settings: dict[str, int]) -> None:
        """Raise the same ValueError on every rank unless every rank's generate() call agrees (its
        prompt, length and `settings`, GENERATE_FIELDS' ints by name), before anything of it runs."""
        if self.dcp_size > 1:
            self._agree(1, [input_ids.shape[0], input_ids.shape[-1], generated_length]
                        + [settings[name] for name in GENERATE_FIELDS[3:-1]] + [_checksum(input_ids)])

    def _agree_on_device(self, values: list[int], input_ids: torch.Tensor | None,
                         attention_mask: torch.Tensor | None) -> None:
        """check_step's agreement with no host sync: [kind, a hash of the host fields, the token
        checksum, the mask's] made on the device (fills and the checksums' kernels, no copy from
        the host), all-gathered, compared there into the `peer_step` error flag. Its vector is
        VECTOR ints, as _agree's, so a peer in another kind of agreement fails it too."""
        vector = torch.zeros(VECTOR, dtype=torch.int64, device=self.device)
        vector[0] = 2
        vector[1] = hash(tuple(values)) & ((1 << 62) - 1)
        if input_ids is not None and input_ids.numel():
            vector[2] = _device_checksum(input_ids)
        if attention_mask is not None and attention_mask.numel():
            vector[3] = _device_checksum(attention_mask.bool())
        gathered = torch.empty(self.dcp_size * VECTOR, dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(gathered, vector, group=self._group())
        per_rank = gathered.view(self.dcp_size, VECTOR)
        differs = (per_rank != per_rank[:1]).any()
        flags = guards.error_flags(self.device)
        flags[guards.INDEX["peer_step"]] |= differs.to(flags.dtype)

    def _agree(self, kind: int, values: list[int]) -> None:
        """One all-gather of [kind, values..] (a vector of VECTOR ints) over the group."""
        vector = torch.zeros(VECTOR, dtype=torch.int64)
        vector[:1 + len(values)] = torch.tensor([kind] + values, dtype=torch.int64)
        vector = vector.to(self.device)
        gathered = torch.empty(self.dcp_size * VECTOR, dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(gathered, vector, group=self._group())
        per_rank = gathered.view(self.dcp_size, VECTOR).tolist()
        if all(row == per_rank[0] for row in per_rank):
            return
        rule = ("Every rank of a DCP group must run the same step with the same batch: the same input shapes, cache "
                "position and token ids (the same generate() call)")
        if len({row[0] for row in per_rank}) > 1:
            given = "; ".join(f"rank {rank} in {KINDS[row[0]]}" for rank, row in enumerate(per_rank))
            raise ValueError(f"the DCP ranks were given different steps: {given}. {rule}")
        names = (STEP_FIELDS, GENERATE_FIELDS)[kind]
        differing = [i for i, _ in enumerate(names) if len({row[1 + i] for row in per_rank}) > 1]
        if len(differing) > 1:  # other shapes or positions: the checksum differs with them
            differing = differing[:-1] if differing[-1] == len(names) - 1 else differing
        given = "; ".join(f"rank {rank}: " + ", ".join(f"{names[i]} {row[1 + i]}" for i in differing)
                          for rank, row in enumerate(per_rank))
        hint = ""
        if kind == 0 and differing == [len(names) - 1]:
            hint = (" (the token ids differ: a token sampled apart on each rank? generate() samples with the group's "
                    "first rank's generator; a loop of your own must sample on one rank and broadcast the token)")
        raise ValueError(f"the DCP ranks were given different {'steps' if kind == 0 else 'generate() calls'}{hint}: "
                         f"{given}. {rule}")

    @contextlib.contextmanager
    def shared_generators(self, device: torch.device):
        """Every rank of the group samples with the first rank's random generators (the CPU's,
        and `device`'s) inside the block; afterwards the other ranks' own are restored."""
        if self.dcp_size == 1:
            yield
            return
        generators = [(torch.get_rng_state, torch.set_rng_state)]
        if device.type != "cpu":
            module = torch.get_device_module(device)
            generators.append((lambda: module.get_rng_state(device), lambda state: module.set_rng_state(state, device)))
        own = [get() for get, _ in generators]
        group = self._group()
        for (_, set_state), state in zip(generators, own):
            shared = state.to(self.device, copy=True)
            dist.broadcast(shared, group=group, group_src=0)
            set_state(shared.cpu())
        try:
            yield
        finally:
            if self.dcp_rank != 0:
                for (_, set_state), state in zip(generators, own):
                    set_state(state)
