"""Sealing a lab instance's cache section before it is signed (modelled and real engines).

The step itself lives in `catsproto.adapters.signed_routes`, shared with `catsproto
instance node --group-key`; the lab's modules import it from here as before.
"""

from __future__ import annotations

from catsproto.adapters.signed_routes import sealed

__all__ = ["sealed"]
