"""`paged-cache stats [--url URL]`: the live counters of a running server (`paged-cache serve`)."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from paged_cache.cli import render
from paged_cache.integrations.stats_http import METRICS_PATH, STATS_PATH
from paged_cache.stats import flatten

DEFAULT_URL = "http://127.0.0.1:8080"  # mlx_lm.server's default --host / --port
EXIT_UNREACHABLE = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the stats subcommand."""
    p = subparsers.add_parser(
        "stats", help="live cache counters of a running server",
        description=f"GET URL{STATS_PATH} (JSON) or, with --prometheus, URL{METRICS_PATH} from a "
                    "running `paged-cache serve` and print them.")
    p.add_argument("--url", default=DEFAULT_URL, help=f"server base URL (default {DEFAULT_URL})")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds (default 5)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the server's JSON document")
    fmt.add_argument("--prometheus", action="store_true", help="print the Prometheus text exposition")
    p.set_defaults(func=run)


def fetch(url: str, path: str, timeout: float) -> bytes:
    """The body of GET url+path; OSError (URLError / HTTPError) when the server does not answer."""
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as response:
        return response.read()


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        return render.fail("stats", f"--timeout: expected seconds > 0, got {args.timeout}")
    if not args.url.startswith(("http://", "https://")):
        return render.fail("stats", f"--url: expected http://HOST:PORT, got {args.url!r}")
    path = METRICS_PATH if args.prometheus else STATS_PATH
    try:
        body = fetch(args.url, path, args.timeout)
    except urllib.error.HTTPError as exc:
        return render.fail("stats", f"{args.url}{path}: HTTP {exc.code}; is this a `paged-cache "
                                    "serve` server?", EXIT_UNREACHABLE)
    except OSError as exc:
        reason = getattr(exc, "reason", exc)
        return render.fail("stats", f"no server answering at {args.url} ({reason}); start one with "
                                    "`paged-cache serve` or pass --url", EXIT_UNREACHABLE)
    try:
        doc = None if args.prometheus else json.loads(body)
    except ValueError as exc:
        return render.fail("stats", f"{args.url}{path} did not return a stats document ({exc})",
                           EXIT_UNREACHABLE)
    if args.prometheus:
        print(body.decode(), end="")
    elif args.json:
        render.print_json(doc)
    else:
        _print(doc)
    return render.EXIT_OK


def headline(doc: dict[str, Any]) -> dict[str, Any]:
    """Hit ratios and tier bytes derived from the document's manager / prefix sections (and the
    remote tier's stats when the server has one)."""
    manager, prefix = doc.get("manager") or {}, doc.get("prefix") or {}
    fetches = (prefix.get("hits") or 0) + (prefix.get("misses") or 0)
    requested = prefix.get("tokens_requested") or 0
    return {
        "fetch_hit_ratio": prefix.get("hits", 0) / fetches if fetches else None,
        "token_hit_ratio": prefix.get("tokens_matched", 0) / requested if requested else None,
        "hot_bytes": (manager.get("hot") or {}).get("bytes"),
        "ssd_bytes": (manager.get("ssd") or {}).get("bytes"),
        "remote": manager.get("remote"),
    }


def _print(doc: dict[str, Any]) -> None:
    out = render.console()
    head = doc.get("paged_cache", {})
    h = headline(doc)
    ratio = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    out.print(f"[bold]server pid {head.get('pid', '?')}[/], up {head.get('uptime_seconds', 0):.0f}s: "
              f"fetch hit ratio {ratio(h['fetch_hit_ratio'])}, token hit ratio "
              f"{ratio(h['token_hit_ratio'])}, hot tier {render.size(h['hot_bytes'])}, "
              f"SSD tier {render.size(h['ssd_bytes'])}")
    remote = h["remote"]
    if remote:
        reads = remote.get("reads") or 0
        mean = f"{remote.get('read_seconds', 0) / reads * 1e3:.2f} ms" if reads else "-"
        out.print(f"remote tier {remote.get('url')}: {'up' if remote.get('available') else 'DOWN'}, "
                  f"{remote.get('hits', 0)} hits, {render.size(remote.get('read_bytes'))} read, "
                  f"{render.size(remote.get('write_bytes'))} written, {remote.get('errors', 0)} "
                  f"errors, {remote.get('damaged', 0)} damaged, mean round trip {mean}")
    for name, section in doc.items():
        if name == "paged_cache" or not isinstance(section, dict):
            continue
        flat = flatten(section)
        out.print(render.table(name, ["counter", "value"],
                               [[k, _number(k, v)] for k, v in sorted(flat.items())],
                               right=("value",)))


def _number(name: str, value: float) -> str:
    """A counter's value; byte counts in the size unit of every other output (format_size)."""
    if name.endswith("bytes") and float(value).is_integer():
        return render.size(int(value))
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
