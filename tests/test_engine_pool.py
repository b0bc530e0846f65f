"""The ingress's keep-alive pool towards the engines (`openai_wire.EnginePool`)."""

from __future__ import annotations

import http.server
import threading
import time

from catsproto.adapters.openai_wire import EnginePool


class _KeepAlive(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        return


def _server() -> http.server.ThreadingHTTPServer:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _ask(pool: EnginePool, port: int, **options: bool) -> bool:
    conn, reused = pool.take("127.0.0.1", port, **options)
    conn.request("GET", "/")
    assert conn.getresponse().read() == b"ok"
    pool.give_back("127.0.0.1", port, conn)
    return reused


def test_an_idle_connection_is_reused_until_the_engine_may_close_it():
    httpd = _server()
    port = httpd.server_address[1]
    pool = EnginePool(idle_s=0.3)
    try:
        assert _ask(pool, port) is False  # the first opens one
        assert _ask(pool, port) is True  # kept alive and taken again
        time.sleep(0.4)  # idle past idle_s: uvicorn would be closing it by now
        assert _ask(pool, port) is False
        assert pool.opened == 2
        assert _ask(pool, port, fresh=True) is False  # a retry never takes an idle one
        assert pool.opened == 3
    finally:
        pool.close()
        httpd.shutdown()
        httpd.server_close()
