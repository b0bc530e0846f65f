"""The lab's error: what the runner, the embedded mode and the flows raise."""

from __future__ import annotations


class LabError(RuntimeError):
    """The lab could not be built or a daemon did not come up."""
