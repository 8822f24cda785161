"""`paged-cache stats [--url URL]`: the live counters of a running server (`paged-cache serve`)."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from paged_cache.cli import render
from paged_cache.integrations.shared.stats_http import HISTOGRAMS, METRICS_PATH, STATS_PATH
from paged_cache.metrics.histograms import quantile
from paged_cache.stats import flatten

DEFAULT_URL = "http://127.0.0.1:8080"  # mlx_lm.server's default --host / --port
OPENAI_SUFFIX = "/v1"                  # the base URL OpenAI clients are given ends with it
EXIT_UNREACHABLE = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the stats subcommand."""
    p = subparsers.add_parser(
        "stats", help="live cache counters of a running server",
        description=f"GET URL{STATS_PATH} (JSON) or, with --prometheus, URL{METRICS_PATH} from a "
                    "running `paged-cache serve` and print a short summary (hits, tokens and "
                    "time to first token saved, what each tier holds); --all adds every counter.")
    p.add_argument("--url", default=DEFAULT_URL,
                   help=f"server base URL or HOST:PORT (taken as http://), with or without the "
                        f"OpenAI /v1 suffix (default {DEFAULT_URL})")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds (default 5)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--all", action="store_true",
                     help="after the summary, every counter of every section")
    fmt.add_argument("--json", action="store_true", help="print the server's JSON document")
    fmt.add_argument("--prometheus", action="store_true", help="print the Prometheus text exposition")
    p.set_defaults(func=run)


def server_root(url: str) -> str:
    """The server's root URL from what a user has: ``http://h:8080``, ``http://h:8080/``, ``h:8080``
    or the OpenAI base URL ``http://h:8080/v1`` all give ``http://h:8080``."""
    url = url.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url[:-len(OPENAI_SUFFIX)] if url.endswith(OPENAI_SUFFIX) else url


def fetch(url: str, path: str, timeout: float) -> bytes:
    """The body of GET url+path; OSError (URLError / HTTPError) when the server does not answer."""
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as response:
        return response.read()


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        return render.fail("stats", f"--timeout: expected seconds > 0, got {args.timeout}")
    path = METRICS_PATH if args.prometheus else STATS_PATH
    url = server_root(args.url)
    if not url.startswith(("http://", "https://")):
        return render.fail("stats", f"--url: expected http://HOST:PORT (or HOST:PORT), got "
                                    f"{args.url!r}")
    try:
        body = fetch(url, path, args.timeout)
    except urllib.error.HTTPError as exc:
        return render.fail("stats", f"{url}{path}: HTTP {exc.code}; is this a `paged-cache "
                                    "serve` server?", EXIT_UNREACHABLE)
    except OSError as exc:
        reason = getattr(exc, "reason", exc)
        return render.fail("stats", f"no server answering at {args.url} ({reason}); start one with "
                                    "`paged-cache serve` or pass --url", EXIT_UNREACHABLE)
    try:
        doc = None if args.prometheus else json.loads(body)
    except ValueError as exc:
        return render.fail("stats", f"{url}{path} did not return a stats document ({exc})",
                           EXIT_UNREACHABLE)
    if args.prometheus:
        print(body.decode(), end="")
    elif args.json:
        render.print_json(doc)
    else:
        _print(doc, url, every=args.all)
    return render.EXIT_OK


def headline(doc: dict[str, Any]) -> dict[str, Any]:
    """The summary figures of a stats document: requests (or prefix-cache fetches) and their hit
    ratio, prompt tokens served from the cache, time to first token and the prefill time the
    cache saved (when the server times them), and each tier's bytes, budget and writes."""
    manager, prefix = doc.get("manager") or {}, doc.get("prefix") or {}
    requests = doc.get("requests") or {}
    if requests:
        total, misses = requests.get("requests", 0), requests.get("requests_miss", 0)
        prompt, cached = requests.get("prompt_tokens", 0), requests.get("cached_tokens", 0)
        by_tier = {t: requests.get(f"requests_{t}", 0) for t in ("hot", "ssd", "remote", "mixed")}
    else:
        misses = prefix.get("misses", 0)
        total = prefix.get("hits", 0) + misses
        prompt, cached = prefix.get("tokens_requested", 0), prefix.get("tokens_saved", 0)
        by_tier = {}
    timed, ttft = requests.get("ttft_requests", 0), requests.get("ttft_seconds", 0.0)
    prefilled, prefill_s = requests.get("prefill_tokens", 0), requests.get("prefill_seconds", 0.0)
    per_token = prefill_s / prefilled if prefilled else None
    return {
        "requests": total, "hits": total - misses, "misses": misses, "hits_by_tier": by_tier,
        "hit_ratio": (total - misses) / total if total else None,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "token_hit_ratio": cached / prompt if prompt else None,
        "ttft_mean_seconds": ttft / timed if timed else None,
        "prefill_seconds_per_token": per_token,
        "ttft_saved_seconds": cached * per_token if per_token is not None else None,
        "hot": _tier(manager.get("hot")), "ssd": _tier(manager.get("ssd")),
        "remote": manager.get("remote"),
        "errors": sum(requests.get(k, 0) for k in ("cache_errors", "store_errors")),
        "prefill_tokens_per_s": prefix.get("prefill_tokens_per_s"),
        "read_bytes_per_s": manager.get("read_bytes_per_s") or {},
        "recomputed_tokens": prefix.get("recomputed_tokens", 0),
    }


def _tier(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tier's bytes, budget, blocks and bytes written (``bytes_written`` where the tier counts
    every byte it writes, else the bytes of the blocks it wrote)."""
    if not stats:
        return None
    written = stats.get("bytes_written", stats.get("write_bytes"))
    return {"bytes": stats.get("bytes"), "max_bytes": stats.get("max_bytes"),
            "blocks": stats.get("blocks"), "written": written}


def _plural(n: int | None, word: str) -> str:
    """``1 block``, ``2 blocks`` (``-`` when unknown)."""
    return "-" if n is None else f"{n} {word}{'s' * (n != 1)}"


def _recomputed(tokens: int) -> str:
    """What the fetch plan prefilled instead of reading, said plainly."""
    if not tokens:
        return "stored tokens found: all read, none prefilled instead"
    return f"{_plural(tokens, 'stored token')} prefilled instead of read (predicted faster)"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """The summary as (label, text) rows."""
    h = headline(doc)
    tiers = ", ".join(f"{n} {name}" for name, n in h["hits_by_tier"].items() if n)
    rows = [["requests", f"{h['requests']}: {h['hits']} hit{'s' * (h['hits'] != 1)}"
                         f"{f' ({tiers})' if tiers else ''}, {h['misses']} "
                         f"miss{'es' * (h['misses'] != 1)}; hit rate {_ratio(h['hit_ratio'])}"],
            ["tokens saved", f"{h['cached_tokens']} of {h['prompt_tokens']} prompt tokens came "
                             f"from the cache ({_ratio(h['token_hit_ratio'])})"]]
    if h["ttft_mean_seconds"] is not None:
        per_token = h["prefill_seconds_per_token"]
        saved = "prefill rate not measured yet" if per_token is None else (
            f"saved ~{render.duration(h['ttft_saved_seconds'])} of prefill (cached tokens x this "
            f"server's {render.duration(per_token)}/token)")
        rows.append(["TTFT", f"mean {render.duration(h['ttft_mean_seconds'])}; {saved}"])
    rows += percentile_rows(doc.get(HISTOGRAMS) or {})
    rates = [f"{name} {render.size(rate)}/s" for name, rate in h["read_bytes_per_s"].items()]
    if h["prefill_tokens_per_s"] is not None or rates:
        prefill = h["prefill_tokens_per_s"]
        rows.append(["fetch plan", f"prefill {'-' if prefill is None else f'{prefill:.0f}'} "
                                   f"tokens/s; reads {', '.join(rates) or '-'}; "
                                   f"{_recomputed(h['recomputed_tokens'])}"])
    for name, label in (("hot", "hot tier"), ("ssd", "SSD tier")):
        tier = h[name]
        if tier is None:
            continue
        used = tier["bytes"] / tier["max_bytes"] if tier["max_bytes"] else None
        text = (f"{render.size(tier['bytes'])} of {render.size(tier['max_bytes'])} "
                f"({_ratio(used)}), {_plural(tier['blocks'], 'block')}")
        if name == "ssd":
            text += f"; {render.size(tier['written'])} written"
        rows.append([label, text])
    remote = h["remote"]
    if remote:
        reads = remote.get("reads") or 0
        mean = render.duration(remote.get("read_seconds", 0) / reads) if reads else "-"
        rows.append(["remote tier",
                     f"{remote.get('url')}: {'up' if remote.get('available') else 'DOWN'}, "
                     f"{_plural(remote.get('hits', 0), 'hit')}, "
                     f"{render.size(remote.get('read_bytes'))} read, "
                     f"{render.size(remote.get('write_bytes'))} written, "
                     f"{_plural(remote.get('errors', 0), 'error')}, {remote.get('damaged', 0)} "
                     f"damaged, mean round trip {mean}"])
    endpoints = doc.get("paged_cache", {}).get("metrics_endpoints") or []
    if endpoints:
        rows.append(["metrics", "; ".join(f"rank {r} {url}" for r, url in enumerate(endpoints))])
    if h["errors"]:
        rows.append(["cache errors", f"{h['errors']} (logged by the server; requests went on "
                                     "uncached)"])
    return rows


def percentile_rows(histograms: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """p50 / p99 of the time to first token by outcome and of a fetch's time by tier, from the
    document's histograms (as Prometheus's histogram_quantile estimates them): a line per series,
    so a server that fetched from every tier shows a column of them, not one wrapped line."""
    rows = []
    for name, label, what in (("time_to_first_token_seconds", "TTFT p50/p99", _outcome),
                              ("fetch_seconds", "fetch p50/p99", lambda s: s["labels"]["tier"])):
        parts = [f"{what(s)} {render.duration(quantile(0.5, s['buckets']))} / "
                 f"{render.duration(quantile(0.99, s['buckets']))} ({s['count']:.0f})"
                 for s in histograms.get(name, [])]
        if parts:
            rows.append([label, "\n".join(parts)])
    return rows


def _outcome(series: dict[str, Any]) -> str:
    """A time-to-first-token series' name for people: ``miss``, ``hit hot``, ``hit ssd``..."""
    labels = series["labels"]
    return "miss" if labels["outcome"] == "miss" else f"hit {labels['tier']}"


def _print(doc: dict[str, Any], url: str, *, every: bool) -> None:
    out = render.console()
    head = doc.get("paged_cache", {})
    out.print(f"[bold]{url}[/]: server pid {head.get('pid', '?')}, up "
              f"{render.duration(head.get('uptime_seconds', 0))}")
    out.print(render.table(None, ["", ""], summary_rows(doc), header=False))
    if not every:
        out.print("[dim]every counter: paged-cache stats --all (or --json, --prometheus)[/]")
        return
    for name, section in doc.items():
        if name in ("paged_cache", HISTOGRAMS) or not isinstance(section, dict):
            continue
        flat = flatten(section)
        out.print(render.table(name, ["counter", "value"],
                               [[k, _number(k, v)] for k, v in sorted(flat.items())],
                               right=("value",)))


def _number(name: str, value: float) -> str:
    """A counter's value in human units: a count of bytes (a name with the word ``bytes``:
    ``ssd.bytes``, ``ssd.bytes_written``, ``hot.max_bytes``) as a size (format_size), seconds
    as a duration."""
    words = name.rsplit(".", 1)[-1].split("_")
    if "bytes" in words and float(value).is_integer():
        return render.size(int(value))
    if "seconds" in words:
        return render.duration(value)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
