"""The compiled parts (numba kernels), each loaded on its first use, and why not.

Importing a kernel module compiles it, or loads its cached machine code, so each is
imported only when first needed. Where that fails (numba missing for the platform, or
its compiler refusing the machine) `Kernel.get` says None and `Kernel.why` says what
failed; the caller then runs its numpy definition: the same answers, slower. Pure: the
loading is an import, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

_UNLOADED = ModuleType("unloaded")


class Kernel:
    """A compiled module, imported by `load` on the first `get`."""

    def __init__(self, load: Callable[[], ModuleType]) -> None:
        self._load = load
        self._module: ModuleType | None = _UNLOADED
        self.why = ""
        """Why the module could not be loaded here (empty while it could)."""

    def get(self) -> ModuleType | None:
        """The module, or None where it cannot be loaded."""
        if self._module is _UNLOADED:
            try:
                self._module = self._load()
            except Exception as exc:  # ImportError, or numba's own errors compiling here
                self._module, self.why = None, f"{type(exc).__name__}: {exc}"
        return self._module
