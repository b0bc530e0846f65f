"""Fetching the Mooncake conversation trace when no folder holds it (IO, beside `trace`).

Strategy: `find_or_download_trace` looks first (`trace.find_trace`, SEARCH_ORDER); only
a trace that is nowhere is downloaded, from the Mooncake project's public repository,
into the user's cache folder, the last place of the search order, where the next run
finds it. The transfer streams into a temporary file in that folder and hashes as it
goes; the file is renamed into place only when its size and sha256 are the release's,
so a cut, padded or altered transfer leaves nothing a later run could take for the
trace. Every failure is one TraceDownloadError that says where to get the file and
where to put it; no HTTP or socket exception escapes.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from catsproto.adapters.trace import (
    CHECKOUT_TRACES,
    MOONCAKE,
    TraceFormatError,
    TraceNotFound,
    cache_folder,
    find_trace,
)

__all__ = [
    "MOONCAKE_SHA256",
    "MOONCAKE_SIZE",
    "MOONCAKE_SOURCE",
    "MOONCAKE_URL",
    "NO_DOWNLOAD_ENV",
    "TraceDownloadError",
    "TraceSource",
    "download_refused",
    "download_trace",
    "find_or_download_trace",
]

# The FAST'25 release's conversation trace (Apache-2.0), byte for byte the file the
# numbers of docs/evaluation.md were measured on.
MOONCAKE_URL = (
    "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/"
    "FAST25-release/traces/conversation_trace.jsonl"
)
MOONCAKE_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
MOONCAKE_SIZE = 3_029_533
NO_DOWNLOAD_ENV = "CATSPROTO_NO_DOWNLOAD"
TIMEOUT_S = 30.0  # per connect or read, not for the whole transfer
CHUNK = 64 * 1024

Progress = Callable[[int, int], None]  # (bytes so far, total bytes)


@dataclass(frozen=True)
class TraceSource:
    """Where a trace is downloaded from, the name it is kept under, and what it must be."""

    name: str
    url: str
    sha256: str
    size: int


MOONCAKE_SOURCE = TraceSource(MOONCAKE, MOONCAKE_URL, MOONCAKE_SHA256, MOONCAKE_SIZE)


class TraceDownloadError(TraceFormatError):
    """The trace is nowhere and could not (or may not) be downloaded; the message says
    where to get it and where to put it."""


def download_refused() -> bool:
    """Whether $CATSPROTO_NO_DOWNLOAD forbids downloading (set, and neither empty nor 0)."""
    return os.environ.get(NO_DOWNLOAD_ENV, "") not in ("", "0")


def find_or_download_trace(
    source: TraceSource | None = None,
    *,
    download: bool | None = None,
    progress: Progress | None = None,
) -> Path:
    """The trace's path: found in SEARCH_ORDER, or else downloaded into the cache folder
    (`download_trace`). `download` False refuses to download, None leaves it to
    $CATSPROTO_NO_DOWNLOAD. A $CATSPROTO_TRACES that is no folder is refused as by
    `find_trace`, before anything is downloaded."""
    source = source or MOONCAKE_SOURCE
    try:
        return find_trace(source.name)
    except TraceNotFound as missing:
        if download is False or (download is None and download_refused()):
            tried = ", ".join(str(p / source.name) for p in missing.places)
            raise TraceDownloadError(
                f"trace {source.name} not found (tried {tried}) and downloading is off "
                f"(--no-download or {NO_DOWNLOAD_ENV}): {where_to_get(source)}"
            ) from None
    return download_trace(source, cache_folder(), progress)


def where_to_get(source: TraceSource) -> str:
    """What a user does by hand: the URL, the digest, and the folders to put it in."""
    return (
        f"get it from {source.url} ({source.size:,} bytes, sha256 {source.sha256}) and "
        f"put it, named {source.name}, in the folder $CATSPROTO_TRACES names, in "
        f"{CHECKOUT_TRACES} or in {cache_folder()}"
    )


def download_trace(source: TraceSource, folder: Path, progress: Progress | None = None) -> Path:
    """Download `source` into `folder` as `source.name`, through a temporary file there
    that is renamed into place once its size and sha256 match (and deleted otherwise).
    `progress(done, total)` after every chunk; without it, a bar on stderr when stderr
    is a terminal."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=folder, prefix=f".{source.name}.", suffix=".part")
    except OSError as exc:
        raise TraceDownloadError(
            f"cannot write the trace into {folder}: {exc.strerror or exc}; {where_to_get(source)}"
        ) from None
    bar = None if progress else _TerminalBar(f"downloading {source.name}")
    temporary = Path(part)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = _fetch(source, out, progress or bar)
        if digest != source.sha256:
            raise TraceDownloadError(
                f"the trace downloaded from {source.url} has sha256 {digest}, not the "
                f"release's {source.sha256}: deleted, not used; {where_to_get(source)}"
            )
        target = folder / source.name
        os.replace(temporary, target)
    except BaseException:
        if bar:
            bar.end()
        temporary.unlink(missing_ok=True)
        raise
    if bar:
        bar.end(f"saved as {target}")
    return target


def _fetch(source: TraceSource, out: BinaryIO, progress: Progress | None) -> str:
    """Stream `source.url` into `out`; the sha256 of exactly `source.size` bytes, or a
    TraceDownloadError (HTTP status, network error, a transfer cut short or too long)."""
    hasher = hashlib.sha256()
    done = 0
    request = urllib.request.Request(source.url, headers={"User-Agent": "catsproto"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            if progress:
                progress(0, source.size)
            while chunk := response.read(CHUNK):
                done += len(chunk)
                if done > source.size:
                    raise TraceDownloadError(
                        f"cannot download {source.name} from {source.url}: the server sent "
                        f"more than the release's {source.size:,} bytes; "
                        f"{where_to_get(source)}"
                    )
                hasher.update(chunk)
                out.write(chunk)
                if progress:
                    progress(done, source.size)
    except urllib.error.HTTPError as exc:
        reason = f"HTTP {exc.code} {exc.reason}"
    except urllib.error.URLError as exc:
        reason = getattr(exc.reason, "strerror", None) or str(exc.reason)
    except TimeoutError:
        reason = f"no answer within {TIMEOUT_S:g} s"
    except (http.client.HTTPException, OSError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    else:
        if done == source.size:
            return hasher.hexdigest()
        reason = f"the transfer stopped after {done:,} of {source.size:,} bytes"
    raise TraceDownloadError(
        f"cannot download {source.name} from {source.url}: {reason}; {where_to_get(source)}"
    )


class _TerminalBar:
    """Bytes so far / total on stderr, redrawn in place; draws nothing unless stderr is
    a terminal (a log or a pipe gets no carriage returns)."""

    def __init__(self, label: str) -> None:
        self.label, self.shown = label, -1
        try:
            self.tty = sys.stderr.isatty()
        except (AttributeError, ValueError):  # replaced or closed
            self.tty = False

    def __call__(self, done: int, total: int) -> None:
        pct = 100 * done // max(1, total)
        if not self.tty or pct == self.shown:
            return
        self.shown = pct
        bar = "#" * (pct // 4) + "-" * (25 - pct // 4)
        sys.stderr.write(f"\r{self.label} [{bar}] {done / 1e6:.1f} / {total / 1e6:.1f} MB")
        sys.stderr.flush()

    def end(self, note: str = "") -> None:
        """Close the bar's line (with a note after it), if a bar was drawn."""
        if self.shown >= 0:
            sys.stderr.write(f" {note}\n" if note else "\n")
            sys.stderr.flush()
            self.shown = -1
