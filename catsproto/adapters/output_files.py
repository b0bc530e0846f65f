"""Checks of a command's output-file options before the command does its work.

A campaign or a matrix takes minutes; an output file it cannot write should be refused
when the command starts, in one line naming the option, not after the run with a
traceback. Each check raises `OutputFileError` (a ValueError) and changes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path


class OutputFileError(ValueError):
    """An output-file option that cannot be honoured; the message names the option."""


def check_writable(option: str, path: str | Path) -> None:
    """`path` can be created or replaced: its folder exists and is writable, and the path
    itself is not a folder (nor an existing file that cannot be written)."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise OutputFileError(f"{option} {path}: is a folder, not a file")
    if not folder.is_dir():
        raise OutputFileError(f"{option} {path}: no folder {folder}")
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputFileError(f"{option} {path}: the file is not writable")
    if not target.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise OutputFileError(f"{option} {path}: the folder {folder} is not writable")


def check_markers(option: str, path: str | Path, begin: str, end: str) -> None:
    """`path` is an existing, writable text file holding `begin` and, after it, `end`
    (the markers a command replaces the text between)."""
    target = Path(path)
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OutputFileError(f"{option} {path}: no such file") from None
    except UnicodeDecodeError:
        raise OutputFileError(f"{option} {path}: not UTF-8 text") from None
    except OSError as exc:
        raise OutputFileError(f"{option} {path}: cannot read: {exc.strerror or exc}") from None
    start = text.find(begin)
    if start < 0 or text.find(end, start + len(begin)) < 0:
        raise OutputFileError(f"{option} {path}: no {begin} ... {end} markers in it")
    if not os.access(target, os.W_OK):
        raise OutputFileError(f"{option} {path}: the file is not writable")
