"""docs/metrics.md against the real servers' GET /metrics, so the page cannot drift.

Strategy. The page's tables are read row by row (metric, type, labels, served by); the
modelled instance, the node face (with its engine scrapes) and the ingress run in this
process as tests/test_openapi.py starts them, get a little traffic so that every family
has samples, and are scraped with their token. For each server the families exposed and
the families listed for it must be the same set, with the same type and label names.
The steering API has no /metrics, and no row may name it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.parser import text_string_to_metric_families

from tests import test_openapi as api

PAGE = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
SCRAPED = ("instance", "node", "ingress")  # the servers with a /metrics
TYPES = ("counter", "gauge", "histogram")
NAME = re.compile(r"^`(catsproto_[a-z0-9_]+)`$")

servers = api.servers  # the same in-process servers (a fixture of this module's own)


@dataclass(frozen=True)
class Family:
    type: str
    labels: frozenset[str]


def documented(page: Path = PAGE) -> dict[str, dict[str, Family]]:
    """Server -> metric name -> its row, from the page's tables."""
    out: dict[str, dict[str, Family]] = {s: {} for s in (*SCRAPED, "steering")}
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("| `catsproto_"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, f"metrics.md:{number}: {len(cells)} cells, not 5"
        m = NAME.match(cells[0])
        assert m is not None, f"metrics.md:{number}: {cells[0]} is not a metric name"
        name, kind, labels, served_by = m.group(1), *cells[1:4]
        assert kind in TYPES, f"metrics.md:{number}: type {kind!r}"
        label_names = re.findall(r"`([a-z_]+)`", labels)
        assert labels == ", ".join(f"`{x}`" for x in label_names), f"metrics.md:{number}"
        for server in (s.strip() for s in served_by.split(",")):
            assert server in out, f"metrics.md:{number}: server {server!r}"
            assert name not in out[server], f"metrics.md:{number}: {name} listed twice"
            out[server][name] = Family(kind, frozenset(label_names))
    return out


def exposed(text: str) -> dict[str, Family]:
    """Metric name (a counter's with ``_total``) -> type and label names, from a scrape;
    a family without samples has no labels to show, so it fails here."""
    out = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        assert family.samples, f"{name}: no samples in the scrape; its labels are unknown"
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        out[name] = Family(family.type, labels)
    return out


def scrape(url: str, token: bytes) -> str:
    reply = api.request(url, "GET", "/metrics", token=token)
    assert reply.status == 200, reply
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    return reply.body.decode()


def compare(server: str, text: str, page: Path = PAGE) -> None:
    listed = documented(page)[server]
    if not prometheus_metrics._use_created:  # PROMETHEUS_DISABLE_CREATED_SERIES
        listed = {k: v for k, v in listed.items() if not k.endswith("_created")}
    seen = exposed(text)
    assert sorted(set(seen) - set(listed)) == [], f"{server}: exposed, not in metrics.md"
    assert sorted(set(listed) - set(seen)) == [], f"{server}: in metrics.md, not exposed"
    for name, family in listed.items():
        assert seen[name] == family, f"{server}: {name}: exposed {seen[name]}, listed {family}"


def test_the_page_lists_each_family_once_per_server_and_the_steering_api_none() -> None:
    rows = documented()
    assert rows["steering"] == {}
    assert all(rows[s] for s in SCRAPED)
    assert len(PAGE.read_text().splitlines()) < 300


def test_the_instance_exposes_what_the_page_lists(servers: api.Servers) -> None:
    s = servers
    body = {"prompt_token_ids": list(range(2000))}  # stores blocks: events, advertisements
    api.request(s.instance.url, "POST", "/generate", body, token=api.INSTANCE_TOKEN)
    compare("instance", scrape(s.instance.url, api.INSTANCE_TOKEN))


def test_the_node_face_exposes_what_the_page_lists(servers: api.Servers) -> None:
    compare("node", scrape(servers.node.url, api.TOKEN))


def test_the_ingress_exposes_what_the_page_lists(servers: api.Servers) -> None:
    url = servers.ingress.url
    for model, prompt in (("tiny", "Hello KV"), ("tiny", "a mismatch"), ("refusing", "x")):
        body = {"model": model, "prompt": prompt}
        api.request(url, "POST", "/v1/completions", body, token=api.TOKEN)
    compare("ingress", scrape(url, api.TOKEN))


def test_the_steering_api_has_no_metrics(servers: api.Servers) -> None:
    reply = api.request(servers.steering.url, "GET", "/metrics", token=api.TOKEN)
    assert reply.status == 404


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("`catsproto_node_hit_ratio` | gauge", "`catsproto_node_hit_ratio` | counter"),
            "exposed F",
        ),
        (("| `catsproto_node_updates_total` |", "| `catsproto_node_updated_total` |"), "not in"),
        (("`instance`, `kind` | instance, node", "`kind` | instance, node"), "exposed F"),
    ],
)
def test_a_page_that_drifted_fails(
    servers: api.Servers, tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    """The comparison can fail: a wrong type, a renamed family, a label left out."""
    old, new = change
    text = PAGE.read_text()
    assert old in text
    drifted = tmp_path / "metrics.md"
    drifted.write_text(text.replace(old, new, 1))
    with pytest.raises(AssertionError, match=message):
        compare("node", scrape(servers.node.url, api.TOKEN), drifted)
