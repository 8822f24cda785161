"""Read-only views of a cache directory: `inspect`, `ls`, `show`, `chains`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import asdict
from typing import Any

from paged_cache.block import HEX, is_key
from paged_cache.cachedir.inventory import CacheDir, check_file, read_header
from paged_cache.cachedir.maintenance import quarantine_files
from paged_cache.cachedir.summary import (ModelSummary, layer_counts, model_of, model_summaries,
                                          prefix_forests, resolve_model)
from paged_cache.cli import render
from paged_cache.cli.options import config_from_args
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.manifest import COMPLETE, Row

SORTS = ("age", "size")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add inspect, ls, show and chains."""
    p = subparsers.add_parser("inspect", help="totals per model of a cache directory",
                              description="Blocks, tokens, bytes, compression, cache types, access "
                                          "times and budget use per model fingerprint (SSD tier); "
                                          "with --remote-url also the remote server's blocks, "
                                          "memory and eviction policy.")
    render.add_dir_arguments(p, fields=("ssd_dir", "ssd_max_bytes", "remote_url",
                                         "remote_cluster", "remote_tls_ca", "remote_tls_cert",
                                         "remote_tls_key"))
    p.set_defaults(func=render.dir_command("inspect", run_inspect))

    p = subparsers.add_parser("ls", help="one row per stored block",
                              description="One row per block of a cache directory, grouped by "
                                          "model: key, tokens, bytes on disk and raw, "
                                          "compression, cache types, last access and whether it "
                                          "is still being written. --sort age lists the "
                                          "least recently used first, the order prune removes "
                                          "them in.")
    render.add_dir_arguments(p)
    p.add_argument("--model", metavar="FP", help="only this model fingerprint (or a unique prefix)")
    p.add_argument("--sort", choices=SORTS, default="age",
                   help="age: least recently used first (default); size: largest first")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="show at most N blocks")
    p.set_defaults(func=render.dir_command("ls", run_ls))

    p = subparsers.add_parser("show", help="one block: metadata, layers, tensors, checksum state",
                              description="One block of a cache directory, named by its key or a "
                                          "unique prefix of one (as ls and chains print them): "
                                          "its manifest row, files, parent and children, "
                                          "metadata, each layer's tensors (name, dtype, shape, "
                                          "bytes) and whether its checksum holds.")
    p.add_argument("where", nargs="+", metavar="[DIR] KEY",
                   help=f"KEY: a block key or a unique prefix of one; DIR: {render.DIR_HELP}")
    render.add_dir_arguments(p, positional=False)
    p.set_defaults(func=_show_entry)

    p = subparsers.add_parser("chains", help="prefix trees: shared blocks, longest chains",
                              description="The prefix trees of a cache directory per model: "
                                          "trees, blocks, conversations (stored sequences), "
                                          "blocks shared between them, the longest chains, and "
                                          "detached trees (whose parent block is gone, so no "
                                          "fetch reaches them).")
    render.add_dir_arguments(p)
    p.add_argument("--limit", type=int, default=5, metavar="N",
                   help="blocks / chains listed per model in the tables (default 5)")
    p.set_defaults(func=render.dir_command("chains", run_chains))


# ---- inspect ---------------------------------------------------------------------------------
def run_inspect(args: argparse.Namespace, cache: CacheDir) -> int:
    rows = cache.rows()
    models = model_summaries(rows.values())
    models_seen = render.stored_models(cache, rows.values())
    total_bytes = sum(r.file_bytes for r in rows.values())
    budget = _budget(args, cache, total_bytes)
    quarantined = quarantine_files(cache)
    totals = {
        "models": len(models),
        "blocks": sum(m.blocks for m in models),
        "reserved": sum(m.reserved for m in models),
        "tokens": sum(m.tokens for m in models),
        "file_bytes": sum(m.file_bytes for m in models),
        "raw_bytes": sum(m.raw_bytes for m in models),
        "manifest_bytes": total_bytes,
    }
    totals["compression_ratio"] = (totals["raw_bytes"] / totals["file_bytes"]
                                   if totals["file_bytes"] else None)
    written, since = cache.written()
    totals["written_bytes"], totals["written_since"] = written, since
    data = {
        "dir": str(cache.path),
        "hot_tier": render.HOT_TIER_NOTE,
        "totals": totals,
        "budget": budget,
        "quarantine": {"files": len(quarantined), "bytes": sum(q.size for q in quarantined)},
        "models": [_model_json(m, models_seen) for m in models],
        "remote": _remote(args),
    }
    if args.json:
        render.print_json(data)
        return render.EXIT_OK
    out = render.console()
    out.print(f"[bold]{cache.path}[/]: {totals['blocks']} blocks, {totals['tokens']} tokens, "
              f"{render.size(totals['file_bytes'])} on disk, {len(models)} model(s)")
    if budget["max_bytes"]:
        out.print(f"SSD budget {render.size(budget['max_bytes'])} ({budget['setting']}, from "
                  f"{budget['source']}): {budget['used_ratio']:.1%} used")
    if since is not None:
        out.print(f"written {render.size(written)} since {render.iso(since)} (block files and "
                  f"the manifest's own writes, as the processes using it recorded them)")
    out.print(render.table(None, ["model", "blocks", "tokens", "on disk", "raw", "ratio",
                                  "cache types", "oldest access", "newest access", "writing"],
                           [[render.model_label(m.fingerprint, models_seen), m.blocks, m.tokens,
                             render.size(m.file_bytes),
                             render.size(m.raw_bytes), _ratio(m.compression_ratio),
                             _types(m.cache_types), render.ago(m.oldest_access),
                             render.ago(m.newest_access), m.reserved] for m in models],
                           right=("blocks", "tokens", "on disk", "raw", "ratio", "writing"),
                           optional=("oldest access", "raw", "writing", "cache types")))
    remote = data["remote"]
    if remote is not None and "error" in remote:
        out.print(f"remote tier {remote['url']}: [red]not answering[/] ({remote['error']})")
    elif remote is not None:
        limit = f"{render.size(remote['maxmemory'])} ({remote['maxmemory_policy']})" \
            if remote["maxmemory"] else f"none ({remote['maxmemory_policy']})"
        out.print(f"remote tier {remote['url']} ({remote['server']}): "
                  f"{remote['blocks']}{'' if remote['counted_all'] else '+'} blocks, "
                  f"{render.size(remote['used_memory'])} used, maxmemory {limit}, "
                  f"{remote['evicted_keys']} evicted, {remote['expired_keys']} expired")
    if quarantined:
        out.print(f"quarantine/: {len(quarantined)} file(s), "
                  f"{render.size(data['quarantine']['bytes'])} (moved aside by verify --repair)")
    out.print(f"[dim]{render.HOT_TIER_NOTE}[/]")
    return render.EXIT_OK


def _remote(args: argparse.Namespace) -> dict[str, Any] | None:
    """The remote server's summary when a remote_url is configured (its error if it does not
    answer: the directory view still prints)."""
    config = config_from_args(args)
    if config.remote_url is None:
        return None
    from paged_cache.cli.remote_summary import server_summary
    from paged_cache.tiers.remote.client import TLSFiles

    try:
        return server_summary(config.remote_url, cluster=config.remote_cluster,
                              tls=TLSFiles.of(config))
    except (OSError, ImportError, ValueError) as exc:  # no answer, refused, no client, an
        # unreadable TLS file: shown, not fatal
        return {"url": config.remote_url.redacted(), "error": str(exc)}


def _budget(args: argparse.Namespace, cache: CacheDir, used: int) -> dict[str, Any]:
    """The SSD budget the effective configuration gives this directory, and its use."""
    config = config_from_args(args)
    budget = dataclasses.replace(config, ssd_dir=cache.path, hot_cache_only=False)
    max_bytes = budget.ssd_budget_bytes(cache_bytes=used)
    return {"max_bytes": max_bytes, "used_bytes": used,
            "used_ratio": used / max_bytes if max_bytes else None,
            "setting": config.ssd_max_bytes, "source": config.sources["ssd_max_bytes"]}


def _model_json(m: ModelSummary, seen: dict[str, render.StoredModel]) -> dict[str, Any]:
    return dict(m.to_dict(), **render.model_json(m.fingerprint, seen),
                oldest_access_iso=render.iso(m.oldest_access),
                newest_access_iso=render.iso(m.newest_access))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _types(counts: dict[str, int]) -> str:
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items())) or "-"


# ---- ls --------------------------------------------------------------------------------------
def run_ls(args: argparse.Namespace, cache: CacheDir) -> int:
    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit: expected an integer >= 0, got {args.limit}")
    rows = list(cache.rows().values())
    if args.model is not None:
        model = resolve_model(args.model, (model_of(r) for r in rows))
        rows = [r for r in rows if model_of(r) == model]
    if args.sort == "size":
        rows.sort(key=lambda r: (-r.file_bytes, r.key))
    else:
        rows.sort(key=lambda r: (r.last_access, r.key))
    rows = rows[:args.limit] if args.limit is not None else rows
    models_seen = render.stored_models(cache, rows)
    if args.json:
        render.print_json([dict(_row_json(r), **{f"model_{k}": v for k, v in
                                                 render.model_json(r.fingerprint, models_seen).items()})
                           for r in rows])
        return render.EXIT_OK
    out = render.console()
    out.print(f"{len(rows)} block(s) in {cache.path}", markup=False)
    # Each model named once, above the table; its rows give the fingerprint alone (a model's
    # name in every row would wrap each of them).
    for fingerprint in dict.fromkeys(r.fingerprint for r in rows):
        if name := render.model_name(fingerprint, models_seen):
            out.print(f"model {render.short(fingerprint)}: {name}", markup=False)
    out.print(render.table(
        None,
        ["key", "model", "tokens", "on disk", "raw", "compression", "cache types", "last access",
         "state"],
        [[render.short(r.key), render.short(r.fingerprint), r.tokens,
          render.size(r.file_bytes), render.size(r.raw_bytes), r.compression,
          _types(layer_counts(r)), render.ago(r.last_access), _state(r)] for r in rows],
        right=("tokens", "on disk", "raw"), optional=("raw", "compression", "state", "cache types")))
    return render.EXIT_OK


def _state(row: Row) -> str:
    return "complete" if row.state == COMPLETE else "writing"


def _row_json(row: Row) -> dict[str, Any]:
    out = asdict(row)
    out.update(state=_state(row), layers=layer_counts(row), created_iso=render.iso(row.created),
               last_access_iso=render.iso(row.last_access))
    return out


# ---- show ------------------------------------------------------------------------------------
def _show_entry(args: argparse.Namespace) -> int:
    if len(args.where) > 2:
        return render.fail("show", f"expected [DIR] KEY, got {len(args.where)} arguments")
    args.dir, args.key = (None, *args.where) if len(args.where) == 1 else args.where
    return render.dir_command("show", run_show)(args)


def run_show(args: argparse.Namespace, cache: CacheDir) -> int:
    rows = cache.rows()
    key = _resolve_key(args.key, rows, cache)
    row = rows.get(key)
    files = cache.files_of(key)
    data: dict[str, Any] = {
        "key": key,
        "manifest": _row_json(row) if row is not None else None,
        "files": [{"path": str(f.path), "compression": f.compression, "bytes": f.size}
                  for f in files],
        "children": sorted(k for k, r in rows.items() if r.parent == key),
    }
    data["checksum"], header = _checksum_state(files)
    data.update(_header_json(header) if header is not None else {"meta": None, "layers": []})
    if args.json:
        render.print_json(data)
        return render.EXIT_OK
    out = render.console()
    out.print(f"[bold]block {key}[/]")
    meta = data["meta"] or {}
    facts = [
        ["model", " ".join(filter(None, (meta.get(fmt.META_MODEL_NAME), meta.get(fmt.META_SHARD),
                                         meta.get(fmt.META_FINGERPRINT) or (row and row.fingerprint)
                                         or "-")))],
        ["namespace", meta.get(fmt.META_NAMESPACE, "-") or "(none)"],
        ["parent", meta.get(fmt.META_PARENT, row.parent if row else None) or "(chain start)"],
        ["tokens", f"{meta.get('start', '?')} + {meta.get(fmt.META_TOKENS, row.tokens if row else '?')}"],
        ["children", len(data["children"])],
        ["files", ", ".join(f"{f['path']} ({render.size(f['bytes'])})" for f in data["files"]) or "none"],
        ["manifest", "no row" if row is None else
         f"{_state(row)}, {row.compression}, last access {render.ago(row.last_access)}"],
        ["checksum", data["checksum"]["state"] + (f": {data['checksum']['reason']}"
                                                  if data["checksum"]["reason"] else "")],
    ]
    out.print(render.table(None, ["", ""], facts, header=False))
    for layer in data["layers"]:
        # the descriptor on a line of its own: a table's title would wrap at the table's width
        out.print(f"layer {layer['index']}: {json.dumps(layer['descriptor'])}", markup=False)
        out.print(render.table(
            None, ["tensor", "dtype", "shape", "bytes"],
            [[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", render.size(t["bytes"])]
             for t in layer["tensors"]], right=("bytes",)))
    return render.EXIT_OK


def _resolve_key(prefix: str, rows: dict[str, Row], cache: CacheDir) -> str:
    prefix = prefix.lower()
    if is_key(prefix):
        return prefix
    if not prefix or not HEX.issuperset(prefix):
        raise ValueError(f"KEY: expected a block key or a prefix of one (hex), got {prefix!r}")
    keys = {k for k in rows if k.startswith(prefix)}
    keys |= {k for k in cache.scan().files if k.startswith(prefix)}
    if len(keys) != 1:
        what = "matches no block" if not keys else f"matches {len(keys)} blocks; give more characters"
        raise ValueError(f"KEY: {prefix!r} {what} in {cache.path}")
    return keys.pop()


def _checksum_state(files: list) -> tuple[dict[str, Any], fmt.Header | None]:
    if not files:
        return {"state": "no file", "reason": None}, None
    try:
        return {"state": "ok", "reason": None}, check_file(files[0])
    except (OSError, ValueError) as exc:
        try:
            header = read_header(files[0])
        except (OSError, ValueError):
            header = None
        return {"state": "damaged", "reason": str(exc)}, header


def _header_json(header: fmt.Header) -> dict[str, Any]:
    meta = {k: v for k, v in header.meta.items() if k not in fmt.RESERVED_META}
    try:
        descriptors = json.loads(meta.get(fmt.META_LAYERS, "[]"))
    except ValueError:
        descriptors = []
    tensors: dict[int, list[dict[str, Any]]] = {}
    for name, dtype, shape, begin, end in header.tensors:
        layer = (fmt.layer_of(name) or (-1,))[0]
        tensors.setdefault(layer, []).append({"name": name, "dtype": dtype.name,
                                              "shape": list(shape), "bytes": end - begin})
    count = max(len(descriptors), max(tensors, default=-1) + 1)
    layers = [{"index": i, "descriptor": descriptors[i] if i < len(descriptors) else None,
               "tensors": tensors.get(i, [])} for i in range(count)]
    if -1 in tensors:
        layers.append({"index": None, "descriptor": None, "tensors": tensors[-1]})
    return {"meta": meta, "format_version": header.meta.get(fmt.META_VERSION),
            "data_checksum": header.meta.get(fmt.META_CHECKSUM), "layers": layers}


# ---- chains ----------------------------------------------------------------------------------
def run_chains(args: argparse.Namespace, cache: CacheDir) -> int:
    if args.limit < 0:
        raise ValueError(f"--limit: expected an integer >= 0, got {args.limit}")
    rows = cache.rows()
    forests = prefix_forests(rows.values())
    models_seen = render.stored_models(cache, rows.values())
    data = []
    for f in forests:
        attached = [t for t in f.trees if not t.detached]
        data.append({
            "fingerprint": f.fingerprint,
            **render.model_json(f.fingerprint, models_seen),
            "trees": len(attached),
            "detached_trees": len(f.trees) - len(attached),
            "blocks": len(f.nodes),
            "detached_blocks": sum(t.blocks for t in f.trees if t.detached),
            "conversations": sum(t.conversations for t in f.trees),
            "shared_blocks": sum(t.shared_blocks for t in f.trees),
            "max_depth": max((t.depth for t in f.trees), default=0),
            "max_tokens": max((t.tokens for t in attached), default=0),
            "tree_list": [asdict(t) for t in f.trees],
            "most_shared": [asdict(n) for n in f.shared(args.limit)],
            "longest": [asdict(n) for n in f.longest(args.limit)],
        })
    if args.json:
        render.print_json(data)
        return render.EXIT_OK
    out = render.console()
    if not data:
        out.print(f"{cache.path}: no stored blocks")
    for d in data:
        out.print(f"[bold]model {render.model_label(d['fingerprint'], models_seen)}[/]: "
                  f"{d['trees']} tree(s), {d['blocks']} blocks, {d['conversations']} "
                  f"conversation(s), {d['shared_blocks']} shared block(s), longest "
                  f"{d['max_tokens']} tokens")
        if d["detached_trees"]:
            out.print(f"  {d['detached_blocks']} block(s) in {d['detached_trees']} detached tree(s): "
                      "their parent block is not on disk, so a fetch cannot reach them from here")
        if d["most_shared"]:
            out.print(render.table("most shared blocks",
                                   ["block", "depth", "ends at token", "conversations"],
                                   [[render.short(n["key"]), n["depth"], n["end_tokens"],
                                     n["conversations"]] for n in d["most_shared"]],
                                   right=("depth", "ends at token", "conversations")))
        else:
            out.print("no block is shared by two conversations")
        out.print(render.table("longest chains", ["last block", "first block", "blocks", "tokens"],
                               [[render.short(n["key"]), render.short(n["root"]), n["depth"],
                                 n["end_tokens"]] for n in d["longest"]],
                               right=("blocks", "tokens")))
    return render.EXIT_OK
