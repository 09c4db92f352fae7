"""Progress on stderr (a tqdm bar when stderr is a terminal; else, for logs such as Slurm's, one line every few
seconds; nothing with --quiet) and summary lines.

The lines every command shares: :func:`human_bytes`, :func:`count` ("1 shard", "2 shards"; its home, with the
verbs that agree with a count, is :mod:`fastio.words`), :func:`skipped_lines`
(skipped inputs by reason, each reason once with its count and first inputs), :func:`parse_size`,
:func:`rate_line`, :func:`table_lines` (columns as wide as their widest cell). Imports nothing of fastio but
:mod:`fastio.words`; ``tqdm`` only when a bar is shown."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from typing import TextIO

from fastio.words import count, one_line

__all__ = ["Progress", "count", "human_bytes", "parse_size", "progress_wanted", "rate_line", "table_lines"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


def progress_wanted(quiet: bool, stream: TextIO | None = None) -> bool:
    """Whether to draw a bar: not ``quiet`` and ``stream`` (default stderr) is a terminal."""
    stream = stream if stream is not None else sys.stderr
    return not quiet and hasattr(stream, "isatty") and stream.isatty()


def parse_size(text: str | int, param: str = "shard_size") -> int:
    """Bytes from ``256MB``, ``1GiB``, ``500k`` or ``1024`` (k/M/G/T decimal, Ki/Mi/Gi/Ti binary).

    ValueError messages name the parameter this reads, ``param`` (``shard_size``, ``cache_size``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise ValueError(f"{param}: cannot read {text!r} as a size (e.g. 256MB, 1GiB, 500k)")
        number, prefix, binary, _ = m.groups()
        if binary and not prefix:
            raise ValueError(f"{param}: cannot read {text!r} as a size (e.g. 256MB, 1GiB, 500k)")
        power = "kmgtp".find(prefix.lower()) + 1 if prefix else 0
        value = int(float(number) * (1024 if binary else 1000) ** power)
    if value <= 0:
        raise ValueError(f"{param} must be positive, got {text!r}")
    return value


def human_bytes(n: float) -> str:
    """``1234567`` -> ``1.2 MB`` (decimal units, as --shard-size reads them)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


SKIPPED_SHOWN = 5
"""Skipped inputs a summary names (the rest: ``fastio inspect DEST --skipped``)."""


def skipped_lines(skipped: list[dict[str, str]], more: str, shown: int = SKIPPED_SHOWN,
                  words: Callable[[str], str] = str) -> str:
    """The skipped inputs by reason, each reason once, its first ``shown`` reasons one line each after a newline:
    ``  PATH: REASON`` for a reason of one input, ``  N inputs (PATH, PATH, PATH, and K more): REASON`` for one of
    several; then, when there are more reasons, a line saying how many inputs they hold and ``more`` (the command
    that lists them all). ``words`` puts each reason's options (``(max_pixels)``) as the reader knows them (a
    command's: ``(--max-pixels)``)."""
    paths: dict[str, list[str]] = {}
    for s in skipped:
        paths.setdefault(one_line(words(str(s.get("reason")))), []).append(one_line(str(s.get("path"))))
    lines = [_skipped_line(reason, found) for reason, found in list(paths.items())[:shown]]
    rest = sum(len(found) for found in list(paths.values())[shown:])
    if rest:
        lines.append(f"  ... and {rest} more: {more}")
    return "".join(f"\n{line}" for line in lines)


def _skipped_line(reason: str, paths: list[str], named: int = 3) -> str:
    if len(paths) == 1:
        return f"  {paths[0]}: {reason}"
    later = f", and {len(paths) - named} more" if len(paths) > named else ""
    return f"  {len(paths)} inputs ({', '.join(paths[:named])}{later}): {reason}"


def rate_line(samples: int, nbytes: int, seconds: float) -> str:
    """``N samples (X MB) in Ts (R samples/s, M MB/s)`` (``1 sample`` for one)."""
    s = max(seconds, 1e-9)
    return (f"{count(samples, 'sample')} ({human_bytes(nbytes)}) in {seconds:.1f}s "
            f"({samples / s:.0f} samples/s, {nbytes / s / 1e6:.1f} MB/s)")


def trained_line(trained: int, tokens: int) -> str:
    """A summary's note of the tokens a conversion of conversations trains (their loss mask set), of ``tokens``."""
    return f"; {count(trained, 'token')} trained ({100 * trained / max(tokens, 1):.1f}%)"


def table_lines(rows: list[list[str]], right: frozenset[int] = frozenset(), gap: str = "  ") -> list[str]:
    """``rows`` (the first the header) as lines whose columns are each as wide as their widest cell: columns
    ``right`` right-aligned, the others left-aligned; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    last = len(widths) - 1
    return [gap.join(cell if i == last else cell.rjust(w) if i in right else cell.ljust(w)
                     for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]


class Progress:
    """Counts samples and bytes; draws a tqdm bar (samples, MB/s, ETA) on stderr when ``enabled``, else with
    ``every_s`` prints one line (``DESC: N/TOTAL samples (P%), R samples/s, M MB/s, ETA T s``) to stderr every
    ``every_s`` seconds.

    Use as a context manager; ``update`` is cheap when disabled.
    """

    def __init__(self, total: int, *, enabled: bool, desc: str = "", every_s: float | None = None) -> None:
        self.total, self.samples, self.bytes = total, 0, 0
        self.desc, self.every_s = desc or "progress", None if enabled else every_s
        self._started = self._last_line = time.monotonic()
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc or None, unit="sample", file=sys.stderr,
                             dynamic_ncols=True, smoothing=0.1, leave=False, postfix="0.0 MB/s")
        self._since_refresh = 0

    def update(self, samples: int = 1, nbytes: int = 0) -> None:
        self.samples += samples
        self.bytes += nbytes
        if self.every_s is not None:
            now = time.monotonic()
            if now - self._last_line >= self.every_s:
                self._last_line = now
                print(self.line(now - self._started), file=sys.stderr, flush=True)
        if self._bar is not None:
            self._since_refresh += samples
            self._bar.update(samples)
            if self._since_refresh >= 16:
                self._since_refresh = 0
                elapsed = self._bar.format_dict.get("elapsed") or 1e-9
                self._bar.set_postfix_str(f"{self.bytes / elapsed / 1e6:.1f} MB/s", refresh=False)

    def line(self, elapsed: float) -> str:
        """The progress line after ``elapsed`` seconds."""
        rate = self.samples / max(elapsed, 1e-9)
        eta = f"{(self.total - self.samples) / rate:.0f} s" if rate > 0 else "unknown"
        pct = 100 * self.samples / self.total if self.total else 100.0
        return (f"{self.desc}: {self.samples}/{count(self.total, 'sample')} ({pct:.0f}%), {rate:.0f} samples/s, "
                f"{self.bytes / max(elapsed, 1e-9) / 1e6:.1f} MB/s, {elapsed:.0f} s elapsed, ETA {eta}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()
