"""The transfer protocol's frame type codes and their names (errors and frames share them)."""

from __future__ import annotations

import enum


class FrameType(enum.IntEnum):
    PULL = 1
    ACCEPT = 2
    BLOCK = 3
    DATA = 4
    EVICTED = 5
    DONE = 6
    CANCEL = 7
    REFUSE = 8


def frame_name(code: int) -> str:
    try:
        return FrameType(code).name.lower()
    except ValueError:
        return f"unknown-{code}"
