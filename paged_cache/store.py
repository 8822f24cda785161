"""Store: cut a live cache list into chained blocks and checkpoints and put them in the manager.

Blocks hold every layer's rows / state for up to ``block_size`` tokens; only blocks the store does
not hold yet are cut. Where some layer cannot be cut by token (recurrent state, a wrapped window,
a chunked window), every store also leaves the state at its end position and at each snapshot
position: in the block ending there when that block is new, else in a checkpoint node (that
state over the block's tokens, no rows of layers a block already holds). A held partial tail
whose tokens a new block extends is dropped when every layer trims to any length, else turned
into a checkpoint of the same tokens (its state stays, the rows the new block holds go). Blocks
of the chain and checkpoints at its positions held only on disk are brought into RAM (the next
turn is a RAM hit): cut again from the live cache when every layer is full history (the same
rows), read back otherwise (a cut may hold less state or window rows than the stored node).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from paged_cache.block import Block
from paged_cache.chain_index import ChainNode
from paged_cache.handlers import restorable_at_end
from paged_cache.hashing import ROOT_PARENT, checkpoint_key
from paged_cache.loans import digest
from paged_cache.row_path import evaluate
from paged_cache.tiers.format import (META_GRID, META_LAYERS, META_MODEL_NAME, META_NAMESPACE,
                                      META_SHARD, array_name, layer_of)

ON_DISK = ("ssd", "remote")  # tiers a block is read from with I/O (a store brings it to RAM)
# not in RAM for the next fetch: on disk, or only in the SSD writer's queue (a block a hit took
# from RAM while its write was queued goes to disk next, unless the store holds it again)
OUT_OF_RAM = ("pending",) + ON_DISK


@dataclass(frozen=True)
class StoreResult:
    """What one store did: blocks and checkpoints written, blocks it found already held."""

    written: int
    checkpoints: int
    deduplicated: int


def store_chain(pc: Any, tokens: np.ndarray, cache: list, snaps: dict, consume: bool,
                grid: tuple[int, int] | None = None) -> StoreResult:
    """Store ``cache`` (positioned at ``len(tokens)``) for prefix cache ``pc`` (see module doc);
    ``grid``: (chunk, until), how the caller prefilled it (META_GRID on the nodes it writes)."""
    layout, manager, bs = pc.layout, pc.manager, pc.block_size
    fp, n = layout.fingerprint, len(tokens)
    ids = np.asarray(tokens, dtype=np.int64)
    keys = pc.chain_keys(tokens)
    spans = [(s, min(s + bs, n)) for s in range(0, n, bs)]
    parents = [keys[j - 1] if j else ROOT_PARENT for j in range(len(keys))]
    tiers, kids = manager.chain(keys, fp, pc.namespace, tokens=ids)
    new = [j for j, tier in enumerate(tiers) if tier is None]
    # Blocks held only on disk (or queued for it) go to RAM too (the next turn is a RAM hit): cut
    # again from the live cache when every layer's rows are all a block holds (the same
    # content), else read back.
    on_disk = [j for j, tier in enumerate(tiers) if tier in OUT_OF_RAM]
    offered = sorted(new + on_disk) if layout.full_history else list(new)
    last = len(keys) - 1
    ckpts: list[tuple[int, int]] = []  # (position, block index)
    if last in new and _covered_by_sibling(kids.get(parents[last], ()), ids, spans[last]):
        new.remove(last)  # a held sibling block already holds these tokens' rows
        offered.remove(last)
        if not layout.full_history:
            ckpts.append((n, last))
    dominated = _dominated_tails(kids, parents, ids, spans, new)
    if layout.full_history:
        for kid in dominated:
            manager.discard(kid.key)
    else:
        for kid in dominated:
            _tail_to_checkpoint(pc, kid)
        restoring = {p: _restoring(kids, parents, ids, spans, p) for p in _positions(snaps, n)}
        promote = [keys[j] for j in on_disk] + _disk_checkpoints(restoring)
        for key in promote:
            pc.read(key)  # read and promoted into RAM
        ckpts += _checkpoint_positions(restoring, spans, new, exclude={p for p, _ in ckpts})
    types = [type(layer).__name__ for layer in cache]
    block_cuts, ckpt_cuts = [], []
    for i, h in enumerate(layout.handlers):
        captures = {b: s.layers[i] for b, s in snaps.items() if i in s.layers}
        block_cuts.append(h.cut(cache[i], [spans[j] for j in offered], captures, n))
        if layout.snapshot_layers[i]:
            ckpt_cuts.append([h.cut_checkpoint(cache[i], spans[j][0], p, captures, n)
                              for p, j in ckpts])
        else:
            ckpt_cuts.append([({}, h.empty_desc(layout.template[i]))] * len(ckpts))
        if consume:  # this layer's rows are copied out before the live layer goes
            evaluate([a for cuts in (block_cuts[-1], ckpt_cuts[-1]) for arrays, _ in cuts
                      for a in arrays.values()])
            cache[i] = None
    if not consume:  # every cut at once: one evaluation, not one per block
        evaluate([a for cuts in block_cuts + ckpt_cuts for arrays, _ in cuts for a in arrays.values()])
    blocks = [_block(pc, keys[j], ChainNode(keys[j], parents[j], fp, spans[j][0],
                                            ids[spans[j][0]:spans[j][1]]),
                     block_cuts, pos, types, grid) for pos, j in enumerate(offered)]
    checkpoints = []
    for pos, (p, j) in enumerate(ckpts):
        s = spans[j][0]
        key = checkpoint_key(fp, pc.namespace, parents[j], tokens[s:p])
        checkpoints.append(_block(pc, key, ChainNode(key, parents[j], fp, s, ids[s:p],
                                                     checkpoint=True),
                                  ckpt_cuts, pos, types, grid))
    # a partial tail waits in RAM: the next store of the conversation usually supersedes it
    tail = {pos for pos, j in enumerate(offered) if spans[j][1] - spans[j][0] < bs}
    written = manager.put_many([b for pos, b in enumerate(blocks) if pos not in tail])
    written += sum(int(bool(manager.put(blocks[pos], deferred=True))) for pos in tail)
    done = manager.put_many(checkpoints)
    return StoreResult(written, done, len(keys) - len(new))


def put_back(pc: Any, layers: list, lent: list) -> int:
    """Give back blocks lent to the live ``layers`` (``loans.Lent``, in chain order): cut each
    lent span again and put it back with its meta when the cut has the lent digest; stop at the
    first that does not (the holder trimmed or rewrote its rows). Returns the blocks put back."""
    handlers = pc.layout.handlers
    live_at = next(o for o in (h.offset(layer) for h, layer in zip(handlers, layers))
                   if o is not None)
    back = 0
    for b in lent:
        arrays: dict[str, mx.array] = {}
        for i, (h, layer) in enumerate(zip(handlers, layers)):
            cut, _ = h.cut(layer, [(b.start, b.end)], {}, live_at)[0]
            arrays.update({array_name(i, name): a for name, a in cut.items()})
        evaluate(list(arrays.values()))
        block = Block(b.key, arrays, b.meta)
        if digest(block) != b.digest:
            break
        pc.manager.put(block)
        back += 1
    return back


def _block(pc: Any, key: str, node: ChainNode, cuts: list[list], pos: int, types: list[str],
           grid: tuple[int, int] | None) -> Block:
    """One node's block from every layer's cut ``pos`` (``node_block``), with the ``grid`` it
    was prefilled on."""
    block = node_block(pc, key, node, cuts, pos, types)
    if grid is not None:
        block.meta[META_GRID] = f"{grid[0]}:{grid[1]}"
    return block


def node_block(pc: Any, key: str, node: ChainNode, cuts: list[list], pos: int,
               types: list[str]) -> Block:
    """The block of ``node`` from every layer's cut ``pos`` (released from ``cuts``): its arrays,
    layer descriptors (with each layer's cache ``types``) and meta."""
    arrays: dict[str, mx.array] = {}
    descs = []
    restorable = True
    for i, layer_cuts in enumerate(cuts):
        block_arrays, desc = layer_cuts[pos]
        arrays.update({array_name(i, name): a for name, a in block_arrays.items()})
        descs.append({"type": types[i], **desc})
        restorable = restorable and (not pc.layout.snapshot_layers[i]
                                     or restorable_at_end(pc.layout.template[i], desc))
        layer_cuts[pos] = None
    node = ChainNode(node.key, node.parent, node.fingerprint, node.start, node.token_ids,
                     node.checkpoint, restorable)
    return Block(key, arrays, _meta(pc, node, descs))


def _covered_by_sibling(siblings: Any, ids: np.ndarray, span: tuple[int, int]) -> bool:
    """True when a held block (not a checkpoint) under the same parent holds more tokens that
    start with this partial block's tokens."""
    s, e = span
    mine = ids[s:e]
    return any(not k.checkpoint and k.ntokens > len(mine)
               and np.array_equal(k.token_ids[:len(mine)], mine) for k in siblings)


def _dominated_tails(kids: dict, parents: list[str], ids: np.ndarray,
                     spans: list[tuple[int, int]], new: list[int]) -> list[ChainNode]:
    """Held partial tails (not checkpoints) whose tokens are a proper prefix of a block this
    store writes: the new block holds their rows."""
    out = []
    for j in new:
        if j and j - 1 in new:
            continue  # the parent is new too: it has no other child yet
        s, e = spans[j]
        mine = ids[s:e]
        out += [kid for kid in kids.get(parents[j], ())
                if not kid.checkpoint and kid.ntokens < len(mine)
                and np.array_equal(mine[:kid.ntokens], kid.token_ids)]
    return out


def _tail_to_checkpoint(pc: Any, tail: ChainNode) -> None:
    """Replace a dominated partial tail by a checkpoint of the same tokens: its state (and the
    rows of windowed layers) stay, the rows of layers a block holds go."""
    block = pc.read(tail.key, take=True)
    pc.manager.discard(tail.key)
    if block is None:
        return
    layout = pc.layout
    descs = json.loads(block.meta[META_LAYERS])
    arrays = {}
    for i, keep in enumerate(layout.snapshot_layers):
        if keep:
            arrays.update({k: v for k, v in block.arrays.items()
                           if (layer_of(k) or (-1,))[0] == i})
        else:
            empty = layout.handlers[i].empty_desc(layout.template[i])
            descs[i] = {"type": descs[i]["type"], **empty}
    key = checkpoint_key(layout.fingerprint, pc.namespace, tail.parent, tail.token_ids)
    node = ChainNode(key, tail.parent, tail.fingerprint, tail.start, tail.token_ids,
                     checkpoint=True, restorable=tail.restorable)
    pc.manager.put(Block(key, arrays, _meta(pc, node, descs)))


def _meta(pc: Any, node: ChainNode, descs: list[dict]) -> dict[str, str]:
    """A node's block meta: its chain fields, layer descriptors, namespace, model name (and shard)."""
    meta = {**node.to_meta(), META_LAYERS: json.dumps(descs), META_NAMESPACE: pc.namespace,
            META_MODEL_NAME: pc.model_name}
    if pc.shard is not None:
        meta[META_SHARD] = pc.shard.describe()
    return meta


def _positions(snaps: dict, n: int) -> list[int]:
    """The store's end and its snapshot positions, ascending."""
    return sorted({b for b in snaps if 0 < b <= n} | {n})


def _restoring(kids: dict, parents: list[str], ids: np.ndarray, spans: list[tuple[int, int]],
               p: int) -> tuple[int, list[ChainNode]]:
    """(index of the block holding position ``p - 1``, held nodes restorable exactly at ``p``)."""
    bs = spans[0][1] - spans[0][0]
    j = (p - 1) // bs
    s = spans[j][0]
    return j, [k for k in kids.get(parents[j], ()) if k.restorable and k.end == p
               and k.start == s and np.array_equal(k.token_ids, ids[s:p])]


def _disk_checkpoints(restoring: dict[int, tuple[int, list[ChainNode]]]) -> list[str]:
    """Checkpoints held only on disk at this store's positions (to read back into RAM)."""
    out = []
    for _, held in restoring.values():
        if held and all(k.tier in ON_DISK for k in held):
            out += [k.key for k in held if k.checkpoint][:1]
    return out


def _checkpoint_positions(restoring: dict[int, tuple[int, list[ChainNode]]],
                          spans: list[tuple[int, int]], new: list[int],
                          exclude: set[int]) -> list[tuple[int, int]]:
    """Of this store's positions (``restoring``: its end and every snapshot, ascending), those
    where no held or new node already restores every layer: (position, index of the block
    holding the position's last token)."""
    out = []
    for p, (j, held) in restoring.items():
        if p in exclude:
            continue
        if (spans[j][1] == p and j in new) or held:
            continue  # the new block ending here carries the state, or a held node does
        out.append((p, j))
    return out
