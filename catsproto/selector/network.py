"""The network as the selector sees it: sites and links with delay and bandwidth.

Paths are shortest by one-way delay (Dijkstra; ties go to fewer hops); a path's
bandwidth is its bottleneck. Pure: the graph comes from a topology file or from a
network metric agent's measurements, through the caller.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Link:
    """A bidirectional link: one-way delay in ms, bandwidth in Mbit/s."""

    a: str
    b: str
    delay_ms: float
    bandwidth_mbps: float

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise ValueError(f"link {self.a}-{self.b} loops on itself")
        if self.delay_ms < 0 or self.bandwidth_mbps <= 0:
            raise ValueError(
                f"link {self.a}-{self.b}: delay {self.delay_ms} ms must be >= 0 and "
                f"bandwidth {self.bandwidth_mbps} Mbit/s > 0"
            )


@dataclass(frozen=True, slots=True)
class Path:
    nodes: tuple[str, ...]
    delay_ms: float  # one way
    bandwidth_mbps: float  # bottleneck

    @property
    def rtt_ms(self) -> float:
        return 2 * self.delay_ms


LOCAL = float("inf")  # bandwidth of the empty path (same node)


class Network:
    """An undirected graph of nodes (sites, routers) and links. `version` moves with
    every `add`: whoever keeps paths worked out from it (a selector) redoes them then."""

    def __init__(self, links: Iterable[Link] = ()):
        self._adj: dict[str, dict[str, Link]] = {}
        self._paths: dict[str, dict[str, Path]] = {}
        self.version = 0
        for link in links:
            self.add(link)

    def add(self, link: Link) -> None:
        """Add or replace a link (e.g. a new delay measurement)."""
        self._adj.setdefault(link.a, {})[link.b] = link
        self._adj.setdefault(link.b, {})[link.a] = link
        self._paths.clear()
        self.version += 1

    @property
    def nodes(self) -> set[str]:
        return set(self._adj)

    def path(self, src: str, dst: str) -> Path | None:
        """Shortest-delay path from src to dst, or None if unreachable."""
        if src == dst:
            return Path((src,), 0.0, LOCAL)
        table = self._paths.get(src)
        if table is None:
            table = self._paths[src] = self._shortest_from(src)
        return table.get(dst)

    def _shortest_from(self, src: str) -> dict[str, Path]:
        if src not in self._adj:
            return {}
        best: dict[str, tuple[float, int]] = {src: (0.0, 0)}
        paths: dict[str, Path] = {}
        heap: list[tuple[float, int, str, tuple[str, ...], float]] = [(0.0, 0, src, (src,), LOCAL)]
        while heap:
            delay, hops, node, nodes, bw = heapq.heappop(heap)
            if node in paths or (delay, hops) > best.get(node, (math.inf, 0)):
                continue
            paths[node] = Path(nodes, delay, bw)
            for nxt, link in self._adj[node].items():
                cand = (delay + link.delay_ms, hops + 1)
                if nxt not in paths and cand < best.get(nxt, (math.inf, 0)):
                    best[nxt] = cand
                    heapq.heappush(heap, (*cand, nxt, (*nodes, nxt), min(bw, link.bandwidth_mbps)))
        return paths
