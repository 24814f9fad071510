"""Image URLs in chat requests: data: URLs decoded; http(s) URLs fetched only from allowed hosts, against
a real HTTP server on loopback, with no redirect followed and the size and time bounded."""

from __future__ import annotations

import base64
import http.server
import threading
import time
from collections.abc import Iterator

import pytest
from helpers import noise_png

from pdserve.engine.sampling_params import BadParameter
from pdserve.router.image_urls import ImageFetch

PNG = noise_png(5, 20, 20)  # about 1.3 KB


class _Handler(http.server.BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self) -> None:  # noqa: N802
        type(self).requests.append(self.path)
        if self.path == "/image.png":
            self._answer(200, PNG)
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/image.png")
            self.end_headers()
        elif self.path == "/big":
            self._answer(200, bytes(4096))
        elif self.path == "/big-undeclared":
            self.send_response(200)
            self.end_headers()  # no content-length: read until the connection closes
            self.wfile.write(bytes(4096))
        elif self.path == "/garbage":
            self.wfile.write(b"SECRET-BANNER of another service\r\n\r\n")  # not HTTP
        elif self.path == "/drip-headers":  # its status line, then a header byte at a time
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for _ in range(40):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        elif self.path == "/drip":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self._answer(404, b"")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Handler.requests = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)  # why: the server answers while the test fetches
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def test_data_urls_are_decoded_and_bad_ones_refused():
    fetch = ImageFetch()
    assert fetch.image_bytes("data:image/png;base64," + base64.b64encode(PNG).decode()) == PNG
    with pytest.raises(BadParameter, match="not a valid data: URL"):
        fetch.image_bytes("data:image/png;base64")


def test_only_allowed_hosts_are_fetched_and_nothing_is_asked_of_others(server):
    port = int(server.rsplit(":", 1)[1])
    allowed = ImageFetch(frozenset({f"127.0.0.1:{port}"}), max_bytes=2048, timeout_s=2.0)
    assert allowed.image_bytes(f"{server}/image.png") == PNG
    for url in (f"http://localhost:{port}/image.png", "http://169.254.169.254/latest/meta-data",
                f"http://127.0.0.1@localhost:{port}/image.png", f"http://user@127.0.0.1:{port}/image.png",
                f"http://127.0.0.1:{port + 1}/image.png", "http://127.0.0.1/image.png",
                "http://127.0.0.1:99999/image.png", "ftp://127.0.0.1/image.png", "file:///etc/passwd"):
        with pytest.raises(BadParameter, match="url_hosts"):
            allowed.image_bytes(url)
    with pytest.raises(BadParameter, match="url_hosts: none"):
        ImageFetch().image_bytes(f"{server}/image.png")
    assert _Handler.requests == ["/image.png"]


@pytest.mark.parametrize(("path", "why"), [
    ("/redirect", r"HTTP 302"), ("/big", "more than the 1024"), ("/big-undeclared", "more than the 1024"),
    ("/missing", "HTTP 404"), ("/drip", "TimeoutError"), ("/drip-headers", "TimeoutError"),
    ("/garbage", r"\(BadStatusLine\)$")])
def test_redirects_sizes_and_slow_servers_are_bounded(server, path, why):
    fetch = ImageFetch(frozenset({server.removeprefix("http://")}), max_bytes=1024, timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(BadParameter, match=why):  # never the peer's own text
        fetch.image_bytes(server + path)
    assert time.monotonic() - started < 2.5  # a drip (4 s of bytes, of the body or the headers) is cut at the deadline
    assert "/image.png" not in _Handler.requests  # a redirect is never followed
