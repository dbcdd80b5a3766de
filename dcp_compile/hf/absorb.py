"""Absorb transformers' MLA attention over the cache read into the canonical dcp::mla_attention.

    before (DeepSeek-V2/V3 `expand_kv` + SDPA, or + the eager matmul-softmax-matmul):
        latent, rope = dcp.mla_cache_view(cache, req_to_token, seq_lens, ids, pos, R)   # [B,1,L,R], [B,1,L,P]
        kv    = linear(latent, W_kv_b).view(B, L, H, n+v).transpose(1, 2)               # [B,H,L,n+v]
        k_n, v = split(kv, [n, v], -1);  key = [k_n | rope.expand(-1, H, -1, -1)]       # cat, or new_empty + copy_
        out   = sdpa(cat(q_nope, q_rope), key, v, attn_mask=mask, scale=s)              # [B,H,T,v]
    after:
        W = W_kv_b.view(H, n+v, R);  W_UK, W_UV = W[:, :n], W[:, n:]
        o = dcp.mla_attention(einsum(q_nope, W_UK) [B*T,H,R], q_rope [B*T,H,P], cache,
                              req_to_token, seq_lens, ids, pos, s)                     # [B*T,H,R]
        out = einsum(o, W_UV).view(B, T, H, v).transpose(1, 2)                         # [B,H,T,v]

Matched on structure and shapes only, never on source text: the view's latent feeds exactly one
bias-free linear whose weight is [H*(n+v), R]; its per-head split is [n, v]; the key is the
nope part followed by the rope part broadcast over the H heads; the query is the cat of a
[B,H,T,n] and a [B,H,T,P] part; the attention is SDPA (dropout 0, not is_causal, a mask) or the
eager form (matmul with the key transposed, times a literal scale, plus a mask, softmax over the
keys in fp32, dropout 0, matmul with the values). The scale is the graph's literal (SDPA's
`scale`, or 1/sqrt(n+P) where it is None; the eager form's factor), so YaRN's mscale is whatever
the model computed. The mask may depend only on the cache's own length counter (no input of
the caller's): the shim's mask is causal over the written positions, which is what
mla_attention computes from seq_lens and the query positions.

Assumes: the graph comes from a model whose cache is dcp_compile.hf.cache.DCPCache.
Guarantees: a rewritten site leaves no linear over the cache read and no SDPA / eager attention
over it; the replacement has the replaced output's shape and dtype (checked). At dcp_size > 1
every cache read must be absorbed: a read that does not match raises AbsorbError naming the
layer, the node that broke the pattern and its source line (a read left in place would read a
sharded pool as if it were whole). At dcp_size 1 an unmatched read stays, and the graph computes
what transformers computes.
Why a pass: the model's code stays untouched; only the captured graph is rewritten.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from dcp_compile.ops import targets
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.cache_use import source_line
from dcp_compile.passes.graph_utils import InputSources, call, check_replacement, fake_value, is_size, size_of
from dcp_compile.regions import OUTER_SOURCES

aten = torch.ops.aten

LINEAR = (torch._C._nn.linear, F.linear, aten.linear.default)
SDPA = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention,
        aten.scaled_dot_product_attention.default)
SPLIT = (torch.functional.split, torch.split, torch.Tensor.split)
CAT = (torch.cat, torch.concat, torch.concatenate, aten.cat.default)
MATMUL = (torch.matmul, operator.matmul, aten.matmul.default)
SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax)
DROPOUT = (F.dropout, torch.dropout)
METADATA_METHODS = ("new_empty", "new_zeros", "size", "dim")
"""Uses of the per-head K/V that read only its shape, dtype and device (transformers' expand_kv
allocates the key with kv.new_empty)."""


class AbsorbError(RuntimeError):
    """A cache read whose attention is not the MLA pattern the absorb pass knows."""


class _Mismatch(Exception):
    def __init__(self, node: fx.Node, expected: str):
        super().__init__(expected)
        self.node, self.expected = node, expected


def _expect(condition: bool, node, expected: str) -> None:
    if not condition:
        raise _Mismatch(node, expected)


def _is(node, functions=(), methods=()) -> bool:
    return isinstance(node, fx.Node) and ((node.op == "call_function" and node.target in functions)
                                          or (node.op == "call_method" and node.target in methods))


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _shape(node) -> tuple:
    value = fake_value(node)
    _expect(isinstance(value, torch.Tensor), node, "a tensor with a recorded shape")
    return tuple(value.shape)


def _is_size_read(node: fx.Node) -> bool:
    """A use that reads only a tensor's sizes (x.size(), x.shape[i], sym_size), never its values."""
    return is_size(node) or _is(node, methods=("size", "dim")) or (
        node.op == "call_function" and node.target is getattr and node.args[1:] == ("shape",))


def _only_user(node: fx.Node, expected: str) -> fx.Node:
    users = list(node.users)
    _expect(len(users) == 1, node, f"exactly one use: {expected} (found {len(users)})")
    return users[0]


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    return {user.args[1]: user for user in node.users
            if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)}


def _last_dim(dim, rank: int) -> bool:
    return dim in (-1, rank - 1)


@dataclass
class AbsorbSite:
    """One matched attention over a cache read, with the nodes and sizes the rewrite uses."""

    view: fx.Node
    output: fx.Node
    """The attention's output [B, H, T, v] (SDPA's, or the eager form's last matmul)."""
    q_nope: fx.Node | None
    q_rope: fx.Node | None
    """The query's two parts where it is a cat of them; None where the query is one tensor (Kimi-Linear's
    MLA), which the rewrite slices."""
    weight: fx.Node
    """kv_b_proj's weight [H*(n+v), R]."""
    sm_scale: float
    heads: int
    nope_dim: int
    value_dim: int
    rank_dim: int
    rope_dim: int
    matched: list[fx.Node]
    """Every node of the pattern, erased once the replacement is in place."""
    query: fx.Node | None = None
    """The query the attention read [B, H, T, n + P]."""
    sized: tuple = ()
    """(tensor, its dims) for the pattern's [B, ., L, .] tensors whose sizes the graph reads (traced
    inside a compile region, expand_kv reads the shapes of the key and its nope part): dims of
    ints, and "B" and "L" for the batch and the cache width."""

    @property
    def layer(self) -> str:
        return layer_name(self.view)


def layer_name(node: fx.Node) -> str:
    """The innermost module the node was traced in, from dynamo's nn_module_stack."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "an unknown layer"
    path, module_type = list(stack.values())[-1]
    return f"{path} ({getattr(module_type, '__name__', module_type)})"


@dataclass
class _MaskRule:
    """What an attention mask over a cache read may depend on: the inputs the graph's cache reads
    come from (the cache's own state), and the padding inputs the front end checks (names ending
    in one of `padding`). sources: the inputs a node depends on, traced through a compile region's
    calls to the step's own (regions.OuterSources)."""

    sources: InputSources
    allowed: frozenset[str]
    padding: tuple[str, ...]

    def check(self, mask, at: fx.Node) -> None:
        _expect(isinstance(mask, fx.Node), at, "an attention mask over the cache read (without one, transformers "
                "attends to every row of the read, unwritten ones included)")
        foreign = sorted(name for name in self.sources(mask) - self.allowed if not name.endswith(self.padding))
        _expect(not foreign, mask, f"a mask computed from the cache's lengths only; it reads the inputs {foreign} (a "
                "padding mask? dcp_compile takes unpadded batches)")


def cache_inputs(views: list[fx.Node], sources: InputSources) -> frozenset[str]:
    """The graph inputs the cache reads' page table, lengths and positions come from (the
    cache's own state): what a mask equal to mla_attention's causal rule may depend on."""
    return frozenset().union(*(sources(arg) for view in views for arg in view.args[1:5]))


def _match_key(k_nope: fx.Node, k_rope: fx.Node, nope_dim: int) -> tuple[fx.Node, list[fx.Node]]:
    """The key [k_nope | k_rope] on the last dim: a cat, or new_empty filled by two copy_ (expand_kv)."""
    readers = [u for u in k_nope.users if not _is_size_read(u)]  # in a compile region expand_kv reads its shape
    _expect(len(readers) == 1, k_nope, f"exactly one use: the key built from the nope part (found {len(readers)})")
    user = readers[0]
    if _is(user, CAT):
        parts, dim = _arg(user, 0, "tensors"), _arg(user, 1, "dim", 0)
        _expect(list(parts) == [k_nope, k_rope] and _last_dim(dim, 4), user, "cat((k_nope, k_rope), dim=-1)")
        return user, [user]
    _expect(_is(user, methods=("copy_",)) and user.args[1] is k_nope, user, "key[..., :n].copy_(k_nope) or a cat")
    nope_slot = user.args[0]
    _expect(nope_slot.target is operator.getitem, nope_slot, "key[..., :n] as the destination of the nope part")
    key = nope_slot.args[0]
    _expect(_is(key, methods=("new_empty", "new_zeros", "empty_like", "zeros_like")), key,
            "the key allocated with new_empty and filled by copy_")
    rope_copy = _only_user(k_rope, "key[..., n:].copy_(k_rope)")
    _expect(_is(rope_copy, methods=("copy_",)) and rope_copy.args[1] is k_rope, rope_copy, "key[..., n:].copy_(k_rope)")
    rope_slot = rope_copy.args[0]
    _expect(rope_slot.target is operator.getitem and rope_slot.args[0] is key, rope_slot, "key[..., n:]")
    for slot, expected in ((nope_slot, slice(None, nope_dim)), (rope_slot, slice(nope_dim, None))):
        index = slot.args[1]
        _expect(isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and index[1] == expected, slot,
                f"key[..., {expected.start or ''}:{expected.stop or ''}]")
    others = {u for u in key.users if not _is_size_read(u)} - {nope_slot, rope_slot}
    _expect(len(others) == 1, key, "the key used only by its two copies and the attention")
    return key, [key, nope_slot, user, rope_slot, rope_copy]


def _check_value(actual, value: fx.Node, attention: fx.Node) -> None:
    """The attention reads the values as split from kv_b_proj's output; a changed value (a model
    that adds a term) is named as the node that broke the pattern."""
    _expect(actual is value, actual if isinstance(actual, fx.Node) else attention,
            "the values split from kv_b_proj's output (split(kv, [n, v])[1]) read by the attention as they are")


def _scale_of_sdpa(node: fx.Node, query_dim: int) -> float:
    scale = _arg(node, 6, "scale")
    _expect(scale is None or isinstance(scale, (int, float)), node, "a literal softmax scale")
    return float(scale) if scale is not None else 1.0 / math.sqrt(query_dim)


def _match_attention(key: fx.Node, value: fx.Node, mask_rule: _MaskRule):
    """(attention output, query, scale, nodes) for SDPA or the eager form reading key and value."""
    users = [u for u in key.users
             if not (u.op == "call_function" and u.target is operator.getitem) and not _is_size_read(u)]
    _expect(len(users) == 1, key, "one attention reading the key")
    user = users[0]
    if _is(user, SDPA):
        _expect(user.args[1] is key, user, "sdpa(query, key, value)")
        _check_value(_arg(user, 2, "value"), value, user)
        _expect(_arg(user, 4, "dropout_p", 0.0) == 0.0, user, "dropout_p == 0 (eval)")
        _expect(_arg(user, 5, "is_causal", False) is False, user, "is_causal=False with an explicit mask")
        _expect(not user.kwargs.get("enable_gqa", False), user, "no enable_gqa (MLA has as many key heads as query heads)")
        mask_rule.check(_arg(user, 3, "attn_mask"), user)
        query = user.args[0]
        return user, query, _scale_of_sdpa(user, _shape(query)[-1]), [user]
    transposed = user
    _expect(_is(transposed, methods=("transpose",)) and tuple(transposed.args[1:]) in ((2, 3), (-2, -1), (3, 2), (-1, -2)),
            transposed, "sdpa(query, key, value) or key.transpose(2, 3) (eager attention)")
    scores = _only_user(transposed, "matmul(query, key^T)")
    _expect(_is(scores, MATMUL, ("matmul",)) and scores.args[1] is transposed, scores, "matmul(query, key^T)")
    query = scores.args[0]
    scaled = _only_user(scores, "the scores times the softmax scale")
    _expect(_is(scaled, (operator.mul, torch.mul)) and isinstance(scaled.args[1], (int, float)), scaled,
            "scores * <literal scale>")
    masked = _only_user(scaled, "scores + mask")
    _expect(_is(masked, (operator.add, torch.add)) and masked.args[0] is scaled, masked, "scores + mask")
    mask_rule.check(masked.args[1], masked)
    softmax = _only_user(masked, "softmax over the keys")
    _expect(_is(softmax, SOFTMAX, ("softmax",)) and _arg(softmax, 1, "dim") in (-1, 3), softmax, "softmax(dim=-1)")
    _expect(softmax.kwargs.get("dtype", _arg(softmax, 3, "dtype")) in (None, torch.float32), softmax,
            "softmax in fp32")
    nodes, probs = [transposed, scores, scaled, masked, softmax], softmax
    following = list(probs.users)
    while len(following) == 1 and (_is(following[0], methods=("to", "type_as")) or _is(following[0], DROPOUT)):
        step = following[0]
        if _is(step, DROPOUT):
            _expect(_arg(step, 1, "p", 0.5) == 0.0 or _arg(step, 2, "training", True) is False, step, "dropout off")
        nodes.append(step)
        probs, following = step, list(step.users)
    # transformers' eager attention also returns the probabilities; only the matmul may read them
    out = [u for u in following if _is(u, MATMUL, ("matmul",))]
    _expect(len(out) == 1 and out[0].args[0] is probs, probs, "matmul(probs, value)")
    _check_value(out[0].args[1], value, out[0])
    _expect(len(following) == 1, probs, "the probabilities read only by matmul(probs, value) (output_attentions off)")
    nodes.append(out[0])
    return out[0], query, float(scaled.args[1]), nodes


def match_site(view: fx.Node, mask_rule: _MaskRule) -> AbsorbSite:
    """Match the attention over one cache read; raises _Mismatch at the first node that breaks it."""
    rank_dim = view.args[5]
    parts = _getitems(view)
    _expect(set(parts) == {0, 1}, view, "both parts of the cache read used (latent and rope)")
    latent, rope = parts[0], parts[1]
    batch, _, width, _ = _shape(latent)
    rope_dim = _shape(rope)[-1]

    readers = [u for u in latent.users if not _is_size_read(u)]  # Kimi-Linear's expand_kv reads kv_nope.shape
    _expect(len(readers) == 1, latent, f"exactly one use: the kv_b_proj linear over the cached latent (found {len(readers)})")
    linear = readers[0]
    _expect(_is(linear, LINEAR) and linear.args[0] is latent, linear, "linear(latent, kv_b_proj.weight)")
    weight, bias = _arg(linear, 1, "weight"), _arg(linear, 2, "bias")
    _expect(isinstance(weight, fx.Node) and bias is None, linear, "a bias-free linear")
    out_features, in_features = _shape(weight)
    _expect(in_features == rank_dim, weight, f"a weight over the latent's R = {rank_dim}")

    per_head = _only_user(linear, "the per-head view of kv_b_proj's output")
    _expect(_is(per_head, methods=("view", "reshape")), per_head, "kv.view(B, L, H, n + v)")
    shape = _shape(per_head)
    _expect(len(shape) == 4 and shape[:2] == (batch, width) and shape[2] * shape[3] == out_features, per_head,
            f"kv.view(B={batch}, L={width}, H, n + v)")
    heads, head_dim = shape[2], shape[3]
    heads_first = _only_user(per_head, "kv.transpose(1, 2)")
    _expect(_is(heads_first, methods=("transpose",)) and tuple(heads_first.args[1:]) in ((1, 2), (2, 1)), heads_first,
            "kv.transpose(1, 2)")
    splits = [u for u in heads_first.users if not _is(u, methods=METADATA_METHODS)]
    _expect(len(splits) == 1 and _is(splits[0], SPLIT, ("split",)), heads_first, "split(kv, [n, v], dim=-1)")
    split = splits[0]
    sizes, dim = _arg(split, 1, "split_size_or_sections"), _arg(split, 2, "dim", 0)
    _expect(isinstance(sizes, (list, tuple)) and len(sizes) == 2 and _last_dim(dim, 4), split,
            "split(kv, [n, v], dim=-1)")
    nope_dim, value_dim = sizes
    _expect(nope_dim + value_dim == head_dim, split, f"split sizes summing to n + v = {head_dim}")
    halves = _getitems(split)
    _expect(set(halves) == {0, 1}, split, "both halves of the split used")
    k_nope, value = halves[0], halves[1]

    k_rope = _only_user(rope, "the rope part broadcast over the heads")
    _expect(_is(k_rope, methods=("expand",)) and _shape(k_rope) == (batch, heads, width, rope_dim), k_rope,
            f"rope.expand(-1, H={heads}, -1, -1)")
    key, key_nodes = _match_key(k_nope, k_rope, nope_dim)
    for tensor, name in ((latent, "the cached latent"), (k_nope, "the key's nope part"), (key, "the key")):
        _expect(_sizes_read_by_dim(tensor), tensor, f"{name}'s sizes read by dimension")
    _expect(_shape(key) == (batch, heads, width, nope_dim + rope_dim), key, "a key [B, H, L, n + P]")

    output, query, scale, attention_nodes = _match_attention(key, value, mask_rule)
    tokens = _shape(query)[2]
    _expect(_shape(query) == (batch, heads, tokens, nope_dim + rope_dim), query,
            f"a query [B, H={heads}, T, n + P={nope_dim + rope_dim}]")
    q_nope = q_rope = None  # a query of one tensor: the rewrite reads its two parts
    if _is(query, CAT):
        _expect(_last_dim(_arg(query, 1, "dim", 0), 4) and len(_arg(query, 0, "tensors")) == 2, query,
                "the query cat((q_nope, q_rope), dim=-1)")
        q_nope, q_rope = _arg(query, 0, "tensors")
        _expect(_shape(q_nope) == (batch, heads, tokens, nope_dim), q_nope, f"q_nope [B, H={heads}, T, n={nope_dim}]")
        _expect(_shape(q_rope) == (batch, heads, tokens, rope_dim), q_rope, f"q_rope [B, H={heads}, T, P={rope_dim}]")
    _expect(_shape(view.args[3])[0] == batch * tokens, view, f"one query id per step token (B*T = {batch * tokens})")
    _expect(_shape(output) == (batch, heads, tokens, value_dim), output, f"an attention output [B, H, T, v={value_dim}]")
    query_users = {u for u in query.users if not _is_size_read(u)} - set(attention_nodes)
    _expect(_sizes_read_by_dim(query), query, "the query's sizes read by dimension")
    _expect(not query_users, query, "the query read only by the attention")
    matched = [view, latent, rope, linear, per_head, heads_first, split, k_nope, value, k_rope, *key_nodes,
               *attention_nodes, *([query] if q_nope is not None else [])]
    return AbsorbSite(view, output, q_nope, q_rope, weight, scale, heads, nope_dim, value_dim, rank_dim, rope_dim, matched,
                      query, ((k_nope, ("B", heads, "L", nope_dim)), (key, ("B", heads, "L", nope_dim + rope_dim))))


def find_sites(graph: fx.Graph, padding_inputs: tuple[str, ...] = ()) -> tuple[list[AbsorbSite],
                                                                               list[tuple[fx.Node, _Mismatch]]]:
    """(matched sites, (cache read, mismatch) for each read that does not match). padding_inputs:
    the graph inputs a mask may read besides the cache's state (placeholders whose names end so):
    a padding mask the front end checked equals the cache's own padding at every step."""
    owner = graph.owning_module
    sources = InputSources(owner.meta.get(OUTER_SOURCES) if owner is not None else None)
    views = [n for n in graph.nodes if n.op == "call_function" and n.target is targets.CACHE_VIEW]
    mask_rule = _MaskRule(sources, cache_inputs(views, sources), tuple(padding_inputs))
    sites, failures = [], []
    for view in views:
        try:
            sites.append(match_site(view, mask_rule))
        except _Mismatch as mismatch:
            failures.append((view, mismatch))
    return sites, failures


def describe_failure(view: fx.Node, mismatch: _Mismatch) -> str:
    node = mismatch.node
    return (f"{layer_name(view)}: the attention over the cache read does not match absorbed MLA at node "
            f"{node.format_node() if isinstance(node, fx.Node) else node!r} ({source_line(node) if isinstance(node, fx.Node) else 'no source'}): "
            f"expected {mismatch.expected}")


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase the pattern's nodes, readers before what they read, once nothing reads them. The
    copy_ into the erased key is read by nobody and goes with it (dead-code elimination keeps
    every in-place write, so it would keep the linear over the cache read alive)."""
    pending = list(dict.fromkeys(nodes))
    # Shape reads of the pattern's tensors (x.shape[:-1] for new_empty) go with them once unread.
    for node in list(pending):
        for reader in node.users:
            if _is_size_read(reader):
                pending += [reader, *(item for item in reader.users if item.target is operator.getitem)]
    pending = list(dict.fromkeys(pending))
    while True:
        dead = [node for node in pending if not node.users]
        if not dead:
            return
        for node in dead:
            graph.erase_node(node)
            pending.remove(node)


def _replace_size_reads(graph: fx.Graph, site: AbsorbSite, req_to_token: fx.Node) -> None:
    """Sizes read off the cached latent [B, 1, L, R] (Kimi-Linear's expand_kv reads kv_nope.shape),
    off the key and its nope part [B, H, L, .] (expand_kv's, traced inside a compile region), read
    off the page table [B, L] instead, and off the query [B, H, T, n + P] (a cat the rewrite
    erases), read off its nope part: so that the cache read and the pattern can go."""
    latent = next(u for u in site.view.users if u.args[1] == 0)
    table = {"B": (req_to_token, 0), "L": (req_to_token, 1)}
    _replace_sizes(graph, latent, [table["B"], 1, table["L"], site.rank_dim])
    for tensor, dims in site.sized:
        _replace_sizes(graph, tensor, [table.get(d, d) for d in dims])
    if site.q_nope is not None:
        query_dims = [(site.q_nope, 0), site.heads, (site.q_nope, 2), site.nope_dim + site.rope_dim]
        _replace_sizes(graph, site.query, query_dims)


def _sizes_read_by_dim(tensor: fx.Node) -> bool:
    """Whether every read of a 4-D tensor's sizes names its dimension (what _replace_sizes rewrites)."""
    for reader in (u for u in tensor.users if _is_size_read(u)):
        if _is(reader, methods=("dim",)) or reader.target is torch.ops.aten.sym_size.int:
            continue
        if _is(reader, methods=("size",)) and len(reader.args) > 1:
            if not isinstance(reader.args[1], int):
                return False
            continue
        if not all(item.target is operator.getitem and isinstance(item.args[1], int) for item in reader.users):
            return False
    return True


def _replace_sizes(graph: fx.Graph, tensor: fx.Node, sizes: list) -> None:
    """Every read of a 4-D `tensor`'s sizes replaced: sizes[dim] is an int, or (node, dim) whose
    size it is (read just before each reader)."""
    def size(dim: int, before: fx.Node):
        value = sizes[dim % 4]
        if isinstance(value, int):
            return value
        with graph.inserting_before(before):
            return size_of(graph, *value)

    for reader in [u for u in tensor.users if _is_size_read(u)]:
        if _is(reader, methods=("dim",)):
            _replace_value(reader, 4)
        elif _is(reader, methods=("size",)) and len(reader.args) > 1 or reader.target is torch.ops.aten.sym_size.int:
            _replace_value(reader, size(reader.args[1], reader))
        else:  # x.size() or x.shape, read by index
            for item in list(reader.users):
                _replace_value(item, size(item.args[1], item))
                graph.erase_node(item)
        graph.erase_node(reader)


def _replace_value(node: fx.Node, value) -> None:
    for user in list(node.users):
        user.args = fx.map_arg(user.args, lambda n: value if n is node else n)
        user.kwargs = fx.map_arg(user.kwargs, lambda n: value if n is node else n)


def rewrite_site(graph: fx.Graph, site: AbsorbSite) -> fx.Node:
    cache, req_to_token, seq_lens, q_seq_ids, q_positions, _ = site.view.args
    _replace_size_reads(graph, site, req_to_token)
    heads, nope, value, rank, rope = site.heads, site.nope_dim, site.value_dim, site.rank_dim, site.rope_dim
    with graph.inserting_before(site.output):
        # Sizes as graph values: a symbolic batch or token count is a sym_size node, never a raw SymInt.
        shaped = site.q_nope if site.q_nope is not None else site.query  # the query cat goes: read its part
        batch, tokens = size_of(graph, shaped, 0), size_of(graph, shaped, 2)
        q_nope, q_rope = site.q_nope, site.q_rope
        if q_nope is None:
            q_nope = call(graph, aten.slice.Tensor, site.query, 3, 0, nope)
            q_rope = call(graph, aten.slice.Tensor, site.query, 3, nope, nope + rope)
        weight = call(graph, aten.view.default, site.weight, [heads, nope + value, rank])
        w_uk = call(graph, aten.slice.Tensor, weight, 1, 0, nope)
        w_uv = call(graph, aten.slice.Tensor, weight, 1, nope, nope + value)
        q_latent = call(graph, aten.einsum.default, "bhtn,hnr->bthr", [q_nope, w_uk])
        q_latent = call(graph, aten.reshape.default, q_latent, [-1, heads, rank])
        q_rope = call(graph, aten.permute.default, q_rope, [0, 2, 1, 3])
        q_rope = call(graph, aten.reshape.default, call(graph, aten.clone.default, q_rope,
                                                        memory_format=torch.contiguous_format),
                      [-1, heads, rope])
        latent_out = call(graph, targets.ATTENTION, q_latent, q_rope, cache, req_to_token, seq_lens, q_seq_ids,
                          q_positions, site.sm_scale)
        out = call(graph, aten.einsum.default, "thr,hvr->thv", [latent_out, w_uv])
        out = call(graph, aten.view.default, out, [batch, tokens, heads, value])
        out = call(graph, aten.permute.default, out, [0, 2, 1, 3])
    check_replacement(site.output, out, AbsorbMLA.name)
    site.output.replace_all_uses_with(out)
    return out


class AbsorbMLA(GraphPass):
    """The front end's pass: every cache read's attention -> canonical absorbed mla_attention."""

    name = "absorb_mla"

    def __init__(self, padding_inputs: tuple[str, ...] = ()):
        self.left_as_is: list[str] = []
        """At dcp_size 1, the layers left to transformers' own attention (why each did not match)."""
        self.padding_inputs = padding_inputs
        """find_sites' padding_inputs."""

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        graph = gm.graph
        sites, failures = find_sites(graph, self.padding_inputs)
        self.left_as_is.extend(describe_failure(v, m) for v, m in failures)
        if failures and config.dcp_size > 1:
            raise AbsorbError(
                f"dcp_size {config.dcp_size}: {len(failures)} of {len(sites) + len(failures)} attention layers over the "
                "DCP cache could not be rewritten into absorbed MLA, and a layer left as it is would read a sharded "
                "cache as if it were whole.\n" + "\n".join(describe_failure(v, m) for v, m in failures)
            )
        for site in sites:
            rewrite_site(graph, site)
            _erase_dead(graph, site.matched)
            if site.view in graph.nodes:
                raise AbsorbError(f"{site.layer}: the cache read is still used by "
                                  f"{[u.format_node() for u in site.view.users]} after the rewrite")
        return len(sites)
