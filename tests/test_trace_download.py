"""The trace comes by itself: lookup order, then the download into the user's cache
folder, against a local HTTP server on 127.0.0.1 (no network). Each place of the lookup
(CATSPROTO_TRACES, the checkout's data/traces, the cache) is a folder under tmp_path."""

from __future__ import annotations

import hashlib
import io
import itertools
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from catsproto import cli
from catsproto.adapters import trace as trace_io
from catsproto.adapters import trace_download as download
from catsproto.adapters.trace import MOONCAKE, TraceFormatError
from catsproto.adapters.trace_download import TraceDownloadError, TraceSource

LINE = '{"timestamp": %d, "input_length": 1024, "output_length": 8, "hash_ids": [%d, %d]}\n'
# a small trace in the Mooncake format, bigger than one read (64 KiB) so the progress
# callback is called more than once, and not a multiple of it
BODY = "".join(LINE % (i * 3000, i, i + 1) for i in range(2500)).encode()


class Served:
    """What the local server answers for each path: (status, body, declared length), and
    how many requests it has seen."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.routes: dict[str, tuple[int, bytes, int]] = {}
        self.requests = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def serve(self, path: str, body: bytes, status: int = 200, declared: int | None = None):
        self.routes[path] = (status, body, len(body) if declared is None else declared)
        return self.url(path)


@pytest.fixture
def server() -> Iterator[Served]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served.requests += 1
            status, body, declared = served.routes.get(self.path, (404, b"no such file", 12))
            self.send_response(status)
            self.send_header("Content-Length", str(declared))
            self.end_headers()
            self.wfile.write(body)  # HTTP/1.0: the connection closes after it

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    served = Served(httpd.server_address[1])
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield served
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture
def places(monkeypatch, tmp_path) -> dict[str, Path]:
    """The three places of the lookup, all under tmp_path and all empty; CATSPROTO_TRACES
    unset, downloading allowed."""
    folders = {
        "env": tmp_path / "env",
        "checkout": tmp_path / "checkout" / "data" / "traces",
        "cache": tmp_path / "xdg" / "catsproto" / "traces",
    }
    folders["env"].mkdir()
    folders["checkout"].mkdir(parents=True)
    monkeypatch.delenv("CATSPROTO_TRACES", raising=False)
    monkeypatch.delenv("CATSPROTO_NO_DOWNLOAD", raising=False)  # conftest sets it
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(trace_io, "CHECKOUT_TRACES", folders["checkout"])
    monkeypatch.setattr(download, "CHECKOUT_TRACES", folders["checkout"])
    return folders


def source_for(url: str, body: bytes = BODY) -> TraceSource:
    return TraceSource(MOONCAKE, url, hashlib.sha256(body).hexdigest(), len(body))


def refused_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port just bound and let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/trace.jsonl"


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def assert_says_where_to_get_it(text: str, source: TraceSource, places: dict[str, Path]):
    assert f"get it from {source.url} ({source.size:,} bytes, sha256 {source.sha256})" in text
    assert f"named {MOONCAKE}, in the folder $CATSPROTO_TRACES names" in text
    assert str(places["checkout"]) in text and str(places["cache"]) in text
    assert "Traceback" not in text


# --- the constants ------------------------------------------------------------------


def test_the_release_constants_are_those_of_the_trace_the_tests_use():
    """MOONCAKE_SIZE and MOONCAKE_SHA256 describe the very file the evaluation ran on (the
    tests find it through the environment, tests/conftest.py)."""
    path = trace_io.find_trace()
    data = path.read_bytes()
    assert len(data) == download.MOONCAKE_SIZE == 3_029_533
    assert hashlib.sha256(data).hexdigest() == download.MOONCAKE_SHA256
    assert download.MOONCAKE_SOURCE.name == MOONCAKE == "mooncake-conversation.jsonl"
    assert download.MOONCAKE_URL == (
        "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/"
        "FAST25-release/traces/conversation_trace.jsonl"
    )


# --- the lookup order -----------------------------------------------------------------


def test_the_lookup_order_is_env_then_checkout_then_cache(places, monkeypatch):
    monkeypatch.setenv("CATSPROTO_TRACES", str(places["env"]))
    assert trace_io.trace_folders() == [places["env"], places["checkout"], places["cache"]]
    places["cache"].mkdir(parents=True)
    for where in ("env", "checkout", "cache"):
        (places[where] / MOONCAKE).write_text(where)
    for where in ("env", "checkout", "cache"):
        found = trace_io.find_trace()
        assert found == places[where] / MOONCAKE and found.read_text() == where
        found.unlink()
    with pytest.raises(trace_io.TraceNotFound):
        trace_io.find_trace()


def test_the_cache_folder_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert trace_io.cache_folder() == tmp_path / "catsproto" / "traces"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/cache"):  # the XDG spec ignores a relative one
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert trace_io.cache_folder() == tmp_path / "home" / ".cache" / "catsproto" / "traces"


def test_no_path_of_the_team_machines_is_looked_in(places):
    assert trace_io.trace_folders() == [places["checkout"], places["cache"]]
    assert "shared" not in trace_io.SEARCH_ORDER


def test_a_catsproto_traces_that_is_no_folder_is_refused_before_any_download(
    places, server, monkeypatch, tmp_path
):
    monkeypatch.setattr(download, "MOONCAKE_SOURCE", source_for(server.serve("/t", BODY)))
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("x")
    for value in (not_a_folder, tmp_path / "nowhere"):
        monkeypatch.setenv("CATSPROTO_TRACES", str(value))
        with pytest.raises(TraceFormatError, match=r"CATSPROTO_TRACES is .*, which is not a fold"):
            download.find_or_download_trace()
    assert server.requests == 0 and files_in(places["cache"]) == []


# --- the download ---------------------------------------------------------------------


def test_a_good_download_lands_in_the_cache_and_is_found_next_time(places, server):
    source = source_for(server.serve("/conversation_trace.jsonl", BODY))
    path = download.find_or_download_trace(source, progress=lambda done, total: None)
    assert path == places["cache"] / MOONCAKE
    assert path.read_bytes() == BODY
    assert files_in(places["cache"]) == [MOONCAKE]  # no temporary file left beside it
    assert server.requests == 1
    assert trace_io.find_trace() == path
    assert download.find_or_download_trace(source) == path
    assert server.requests == 1  # found, not downloaded again
    assert len(trace_io.read_trace(path)) == 2500


def test_a_trace_found_anywhere_is_not_downloaded(places, server):
    source = source_for(server.serve("/t", BODY))
    (places["checkout"] / MOONCAKE).write_bytes(b"{}")
    assert download.find_or_download_trace(source) == places["checkout"] / MOONCAKE
    assert server.requests == 0 and files_in(places["cache"]) == []


def test_a_wrong_digest_is_refused_and_leaves_nothing_behind(places, server):
    altered = BODY.replace(b'"output_length": 8', b'"output_length": 9', 1)
    assert len(altered) == len(BODY)
    source = source_for(server.serve("/t", altered), BODY)  # the digest of BODY
    with pytest.raises(TraceDownloadError) as caught:
        download.find_or_download_trace(source, progress=lambda done, total: None)
    text = str(caught.value)
    assert f"has sha256 {hashlib.sha256(altered).hexdigest()}, not the release's " in text
    assert f"not the release's {source.sha256}: deleted, not used" in text
    assert_says_where_to_get_it(text, source, places)
    assert files_in(places["cache"]) == []
    with pytest.raises(trace_io.TraceNotFound):
        trace_io.find_trace()


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("truncated", f"the transfer stopped after 40,000 of {len(BODY):,} bytes"),
        ("too long", f"the server sent more than the release's {len(BODY):,} bytes"),
        ("404", "HTTP 404 Not Found"),
        ("500", "HTTP 500 Internal Server Error"),
        ("refused", "Connection refused"),
    ],
)
def test_a_failed_transfer_says_where_to_get_the_file(places, server, case, reason):
    if case == "truncated":  # declares the whole length, sends 40,000 bytes, hangs up
        url = server.serve("/t", BODY[:40_000], declared=len(BODY))
    elif case == "too long":
        url = server.serve("/t", BODY + BODY[:100])
    elif case == "404":
        url = server.url("/t")  # nothing served there
    elif case == "500":
        url = server.serve("/t", b"oops", status=500)
    else:
        url = refused_url()
    source = source_for(url)
    with pytest.raises(TraceDownloadError) as caught:
        download.find_or_download_trace(source, progress=lambda done, total: None)
    text = str(caught.value)
    assert text.startswith(f"cannot download {MOONCAKE} from {url}: {reason}; "), text
    assert_says_where_to_get_it(text, source, places)
    assert files_in(places["cache"]) == []


def test_an_interrupted_download_leaves_nothing_behind(places, server):
    source = source_for(server.serve("/t", BODY))

    def interrupt(done: int, total: int) -> None:
        if done > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        download.find_or_download_trace(source, progress=interrupt)
    assert files_in(places["cache"]) == []


def test_the_progress_callback_sees_increasing_counts_ending_at_the_total(places, server):
    source = source_for(server.serve("/t", BODY))
    seen: list[tuple[int, int]] = []
    download.find_or_download_trace(source, progress=lambda done, total: seen.append((done, total)))
    counts = [done for done, _ in seen]
    assert {total for _, total in seen} == {len(BODY)}
    assert counts[0] == 0 and counts[-1] == len(BODY) and len(counts) >= 3
    assert all(a < b for a, b in itertools.pairwise(counts))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_is_drawn_on_a_terminal_only(places, server, monkeypatch, capsys):
    source = source_for(server.serve("/t", BODY))
    download.find_or_download_trace(source)  # stderr captured: not a terminal
    assert capsys.readouterr().err == ""
    (places["cache"] / MOONCAKE).unlink()
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    path = download.find_or_download_trace(source)
    drawn = terminal.getvalue()
    mb = f"{len(BODY) / 1e6:.1f}"
    assert drawn.startswith(f"\rdownloading {MOONCAKE} [-------------------------] 0.0 / {mb} MB")
    assert drawn.endswith(f"[#########################] {mb} / {mb} MB saved as {path}\n")
    assert drawn.count("\n") == 1


# --- refusing to download, and the commands ---------------------------------------------


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_downloading_can_be_refused(places, server, monkeypatch, how):
    source = source_for(server.serve("/t", BODY))
    if how == "environment":
        monkeypatch.setenv("CATSPROTO_NO_DOWNLOAD", "1")
    with pytest.raises(TraceDownloadError) as caught:
        download.find_or_download_trace(source, download=False if how == "argument" else None)
    text = str(caught.value)
    assert text.startswith(f"trace {MOONCAKE} not found (tried {places['checkout'] / MOONCAKE}")
    assert "and downloading is off (--no-download or CATSPROTO_NO_DOWNLOAD)" in text
    assert_says_where_to_get_it(text, source, places)
    assert server.requests == 0
    monkeypatch.setenv("CATSPROTO_NO_DOWNLOAD", "0")  # 0 does not refuse
    assert download.find_or_download_trace(source, progress=lambda d, t: None).is_file()


def test_eval_downloads_the_trace_when_it_is_nowhere(places, server, monkeypatch, capsys):
    monkeypatch.setattr(download, "MOONCAKE_SOURCE", source_for(server.serve("/t", BODY)))
    argv = ["eval", "--limit", "40", "--policies", "nearest", "--speedup", "1", "--quiet"]
    assert cli.main([*argv, "--no-download", "--sweep-limit", "0"]) == 2
    assert "downloading is off" in capsys.readouterr().err and server.requests == 0
    assert cli.main([*argv, "--sweep-limit", "0", "--json"]) == 0
    assert server.requests == 1
    assert (places["cache"] / MOONCAKE).read_bytes() == BODY
    assert '"policy": "nearest"' in capsys.readouterr().out


def test_eval_offline_says_where_to_get_the_trace_in_one_message(places, monkeypatch, capsys):
    source = source_for(refused_url())
    monkeypatch.setattr(download, "MOONCAKE_SOURCE", source)
    assert cli.main(["eval", "--limit", "5", "--policies", "nearest", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"catsproto eval: cannot download {MOONCAKE} from {source.url}: ")
    assert err.count("\n") == 1
    assert_says_where_to_get_it(err, source, places)


def test_the_demo_skips_its_evaluation_with_the_reason_when_offline(places, monkeypatch, capsys):
    source = source_for(refused_url())
    monkeypatch.setattr(download, "MOONCAKE_SOURCE", source)
    assert cli.eval_demo(40) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"trace-driven evaluation skipped: cannot download {MOONCAKE} from ")
    assert_says_where_to_get_it(out, source, places)
    assert cli.build_parser().parse_args(["demo", "--no-download"]).no_download
