"""The saved estimates (``rates.json`` in the SSD cache directory): what a manager measured, read
back at the next open so a new process does not plan blind. The one owner of the file's format.

Written on flush and close (merged with what other processes sharing the directory saved: their
models and layouts stay), read at open. What is read back is untrusted input: a file that is not
a small regular JSON object of the expected shape, with every rate finite, positive and within
bounds, is ignored whole (the caller counts and logs it); nothing here raises on a bad file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from paged_cache.tiers.ssd.files import READ_FLAGS, read_exact

log = logging.getLogger("paged_cache.manager")

FILE_NAME = "rates.json"
READ_TIERS = ("hot", "ssd", "remote")  # tiers whose read rate is kept ("pending" reads are RAM)
FORMAT = "paged-cache-rates"
VERSION = 1
MAX_FILE_BYTES = 1 << 20     # a larger file is refused unread
MAX_ENTRIES = 256            # models, and layouts, kept per map (the ones saved last win)
MAX_NAME = 1024              # characters of a model identity or a layout fingerprint
# Accepted ranges: far outside anything a machine does, so a value beyond them is damage.
BOUNDS = {"prefill_tokens_per_s": (1e-3, 1e9), "read_bytes_per_s": (1.0, 1e13),
          "bytes_per_token": (1.0, float(1 << 30))}


@dataclass
class SavedRates:
    """Estimates to keep: prefill tokens/s by model identity, read bytes/s by tier, bytes per
    token by layout fingerprint."""

    prefill_tokens_per_s: dict[str, float] = field(default_factory=dict)
    read_bytes_per_s: dict[str, float] = field(default_factory=dict)
    bytes_per_token: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        """The file's JSON object."""
        return {"format": FORMAT, "version": VERSION, "prefill_tokens_per_s":
                self.prefill_tokens_per_s, "read_bytes_per_s": self.read_bytes_per_s,
                "bytes_per_token": self.bytes_per_token}

    def over(self, older: "SavedRates") -> "SavedRates":
        """These estimates that a reader accepts (a model id with a control character or longer
        than MAX_NAME, a rate beyond the bounds, is not kept), and those of ``older`` (another
        process's) for the names these lack; at most MAX_ENTRIES per map, these first."""
        maps = {}
        for name in BOUNDS:
            mine = {k: v for k, v in getattr(self, name).items() if _wrong(name, k, v) is None}
            theirs = getattr(older, name)
            merged = {**mine, **{k: v for k, v in theirs.items() if k not in mine}}
            maps[name] = dict(list(merged.items())[:MAX_ENTRIES])
        return SavedRates(**maps)


class BadRatesFile(ValueError):
    """The saved file cannot be used; the message says what is wrong with it."""


def load(directory: os.PathLike | str) -> SavedRates | None:
    """The estimates saved in ``directory``; None when there is no file; BadRatesFile saying why
    when there is one that cannot be used (the caller counts it and goes on without)."""
    try:
        fd = os.open(Path(directory) / FILE_NAME, READ_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadRatesFile(f"cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadRatesFile("is not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise BadRatesFile(f"holds {st.st_size} bytes, more than {MAX_FILE_BYTES}")
        data = bytes(read_exact(fd, MAX_FILE_BYTES + 1))
    except OSError as exc:
        raise BadRatesFile(f"cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise BadRatesFile(f"holds more than {MAX_FILE_BYTES} bytes")
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadRatesFile(f"is not JSON: {exc}") from None
    return parse(parsed)


def parse(obj: object) -> SavedRates:
    """``SavedRates`` from the file's JSON object; BadRatesFile naming the first bad field."""
    if not isinstance(obj, dict):
        raise BadRatesFile(f"holds a {type(obj).__name__}, not a JSON object")
    if obj.get("format") != FORMAT or obj.get("version") != VERSION:
        raise BadRatesFile(f"format/version: expected {FORMAT!r} {VERSION}, got "
                           f"{obj.get('format')!r} {obj.get('version')!r}")
    unknown = set(obj) - {"format", "version", *BOUNDS}
    if unknown:
        raise BadRatesFile(f"unknown fields {sorted(unknown)!r:.100}")
    maps = {}
    for name in BOUNDS:
        got = obj.get(name, {})
        if not isinstance(got, dict) or len(got) > MAX_ENTRIES:
            raise BadRatesFile(f"{name}: expected an object of at most {MAX_ENTRIES} entries")
        for key, value in got.items():
            wrong = _wrong(name, key, value)
            if wrong:
                raise BadRatesFile(wrong)
        maps[name] = {k: float(v) for k, v in got.items()}
    return SavedRates(**maps)


def _wrong(name: str, key: object, value: object) -> str | None:
    """What is wrong with the entry ``key: value`` of the map ``name``, None when it fits."""
    low, high = BOUNDS[name]
    if name == "read_bytes_per_s" and key not in READ_TIERS:
        return f"{name}: {key!r:.40} is not a tier ({', '.join(READ_TIERS)})"
    if not isinstance(key, str) or not 0 < len(key) <= MAX_NAME or not key.isprintable():
        return f"{name}: {key!r:.40} is not a name of 1-{MAX_NAME} printable characters"
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not low <= value <= high or not math.isfinite(value):  # an int of 400 digits too
        return (f"{name}[{key!r:.40}]: expected a number in [{low:g}, {high:g}], got "
                f"{value!r:.40}")
    return None


def save(directory: os.PathLike | str, rates: SavedRates) -> None:
    """Write ``rates`` over what ``directory`` holds (a bad file is replaced), atomically: a
    private temporary file renamed into place. OSError when it cannot be written."""
    directory = Path(directory)
    try:
        older = load(directory) or SavedRates()
    except BadRatesFile:
        older = SavedRates()
    text = json.dumps(rates.over(older).to_json(), sort_keys=True, indent=1)
    tmp = directory / f"{FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, directory / FILE_NAME)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_counted(directory: Path | None, counters: dict[str, int]) -> SavedRates | None:
    """The estimates saved in ``directory`` (None: no SSD directory) for a manager opening it;
    one read counts ``rates_loaded``, a file that cannot be used is a logged miss counted in
    ``rates_rejected`` (``counters``: the manager's)."""
    if directory is None:
        return None
    try:
        saved = load(directory)
    except BadRatesFile as exc:
        counters["rates_rejected"] += 1
        log.warning("ignoring the saved rates %s: it %s", Path(directory) / FILE_NAME, exc)
        return None
    if saved is not None:
        counters["rates_loaded"] += 1
    return saved


def save_measured(directory: Path | None, measured: dict) -> bool:
    """Save ``measured`` (``Rates.measured()``) in ``directory`` for the next process; False
    (logged, never raised) when it could not be written. Nothing measured: nothing written."""
    if directory is None or not any(measured.values()):
        return True
    try:
        save(directory, SavedRates(**measured))
    except OSError as exc:
        log.warning("could not save the measured rates in %s: %s", directory, exc)
        return False
    return True
