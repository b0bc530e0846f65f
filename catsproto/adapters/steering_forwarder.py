"""The forwarder: host routes to the chosen instance, installed over rtnetlink.

Strategy: a decision names an instance and a path; `Forwarder` installs (or replaces)
the host route that sends the request's traffic along it, marked with its own rtnetlink
protocol number so that it removes only what it installed. `catsproto.adapters.steering`
is the daemon.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ROUTE_PROTO = 250  # rtnetlink protocol number marking the routes this forwarder owns


class SteeringError(ValueError):
    """A request the steering API cannot serve (the message says which field). Here, in
    the steering's lowest part, because the forwarder raises it too."""


@dataclass
class InstalledRoute:
    address: str
    gateway: str | None  # None: the instance is at the ingress's own site
    path: tuple[str, ...]
    installed_at: float
    uses: int = 1

    def to_json(self) -> dict[str, Any]:
        text = (
            f"{self.address}/32 via {self.gateway} proto {ROUTE_PROTO}"
            if self.gateway
            else f"{self.address}: local site, no route needed"
        )
        return {
            "address": self.address,
            "gateway": self.gateway,
            "path": list(self.path),
            "route": text,
            "uses": self.uses,
        }


class Forwarder:
    """Installs one host route per steered instance towards the chosen path's first hop."""

    def __init__(
        self,
        next_hops: dict[str, str],
        *,
        source: str | None = None,
        netns: str | None = None,
        dry_run: bool = False,
    ) -> None:
        self.next_hops = dict(next_hops)
        self.source = source
        self.netns = netns
        self.dry_run = dry_run
        self.installed: dict[str, InstalledRoute] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _ipr(self) -> Iterator[Any]:
        from pyroute2 import IPRoute, NetNS

        ipr = NetNS(self.netns) if self.netns else IPRoute()
        try:
            yield ipr
        finally:
            ipr.close()

    def install(self, address: str, path: tuple[str, ...]) -> InstalledRoute:
        """Route `address` along `path` (ingress first); idempotent for the same path."""
        gateway = self.next_hops.get(path[1]) if len(path) > 1 else None
        if len(path) > 1 and gateway is None:
            raise SteeringError(f"no next hop towards {path[1]} from {path[0]}")
        with self._lock:
            old = self.installed.get(address)
            if old is not None and old.gateway == gateway:
                old.uses += 1
                old.path = path
                return old
            if gateway is not None and not self.dry_run:
                kwargs: dict[str, Any] = {"dst": f"{address}/32", "gateway": gateway}
                if self.source:
                    kwargs["prefsrc"] = self.source
                with self._ipr() as ip:
                    ip.route("replace", proto=ROUTE_PROTO, **kwargs)
            route = InstalledRoute(address, gateway, path, time.time())
            self.installed[address] = route
            return route

    def kernel_routes(self) -> list[str]:
        """The routes of protocol ROUTE_PROTO in the table, as the kernel has them."""
        with self._ipr() as ip:
            out = []
            for r in ip.get_routes(family=2, proto=ROUTE_PROTO):
                dst = r.get_attr("RTA_DST")
                gw = r.get_attr("RTA_GATEWAY")
                out.append(f"{dst}/{r['dst_len']} via {gw}")
            return out

    def remove_all(self) -> None:
        with self._lock:
            if not self.dry_run:
                with self._ipr() as ip:
                    for route in self.installed.values():
                        if route.gateway is not None:
                            with contextlib.suppress(Exception):
                                ip.route("del", dst=f"{route.address}/32", proto=ROUTE_PROTO)
            self.installed.clear()
