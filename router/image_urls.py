"""Images a chat request names by URL: inline `data:` URLs always; `http(s)` URLs only from the hosts the
manifest allows (`server.images.url_hosts`), fetched with bounds.

An open fetcher would let any client make the router request any address it can reach (cloud metadata
services, internal hosts): so a host must be named exactly (with its port, when not the scheme's own),
URLs with user info are refused, and so are redirects (one could lead off
the allowed host), and the body is read against a byte limit, all of it against an overall deadline (a
server that drips its headers or its body cannot hold the thread longer: urllib's timeout bounds each
read, not the fetch, so the socket is shut at the deadline). Runs on the router's tokenizer threads,
never its event loop.
"""

from __future__ import annotations

import binascii
import functools
import http.client
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from pdserve.engine.sampling_params import BadParameter

CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class ImageFetch:
    hosts: frozenset[str] = frozenset()  # lower-case host names whose http(s) URLs are fetched
    max_bytes: int = 8 << 20
    timeout_s: float = 10.0  # the whole fetch: connecting, headers and body

    def image_bytes(self, url: str) -> bytes:
        """The image an `image_url` part names; BadParameter (param `messages`) saying why not."""
        scheme = url.partition(":")[0].lower()
        if scheme == "data":
            try:
                with urllib.request.urlopen(url) as response:  # the standard library's data: URL decoder
                    return response.read()
            except (ValueError, binascii.Error, OSError) as e:
                raise BadParameter("messages", f"image_url is not a valid data: URL ({type(e).__name__})") from None
        host = _host(url) if scheme in ("http", "https") else None
        if host is None or host not in self.hosts:
            raise BadParameter("messages", "image_url must be a data: URL carrying the image (data:image/png;base64,"
                                           "...), or an http(s) URL on a host the server allows (server.images."
                                           f"url_hosts{': none' if not self.hosts else ''})")
        return self._fetch(url, host)

    def _fetch(self, url: str, host: str) -> bytes:
        watchdog = _Watchdog(self.timeout_s)
        opener = urllib.request.build_opener(_NoRedirects, _WatchedHTTP(watchdog), _WatchedHTTPS(watchdog))
        try:
            with watchdog, opener.open(urllib.request.Request(url, headers={"Accept": "image/*"}),
                                       timeout=self.timeout_s) as r:
                declared = r.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise BadParameter("messages", f"the image at {host} has {declared} bytes, more than the "
                                                   f"{self.max_bytes} allowed")
                body = bytearray()
                while chunk := r.read1(CHUNK_BYTES):  # what has arrived (the watchdog ends a read at the deadline)
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise BadParameter("messages", f"the image at {host} has more than the {self.max_bytes} "
                                                       "bytes allowed")
                if watchdog.expired:  # the socket was shut: what came is not the whole image
                    raise TimeoutError
                return bytes(body)
        except BadParameter:
            raise
        except urllib.error.HTTPError as e:
            e.close()
            raise BadParameter("messages", f"the image at {host} could not be fetched (HTTP {e.code})") from None
        except (OSError, ValueError, http.client.HTTPException) as e:  # refused, unreachable, timed out, malformed
            why = "TimeoutError" if watchdog.expired else type(e).__name__
            raise BadParameter("messages", f"the image at {host} could not be fetched ({why})") from None


def _host(url: str) -> str | None:
    """The URL's host as `url_hosts` names it: `host`, or `host:port` for a port not its scheme's own
    (so that an allowed host's other services cannot be reached through it)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:  # a port out of range or not a number
        return None
    if parts.hostname is None or parts.username is not None or parts.password is not None:
        return None
    default = {"http": 80, "https": 443}[parts.scheme.lower()]
    return parts.hostname if port in (None, default) else f"{parts.hostname}:{port}"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect could lead off the allowed host: it ends the fetch (as an HTTPError of its status)."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


class _Watchdog:
    """Shuts a fetch's socket down when its time is up, which ends whatever read waits on it. A timer
    thread does it: the fetching thread is blocked in that read."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def watch(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._socket = sock
            if self.expired:
                _shut(sock)
        return sock

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            if self._socket is not None:
                _shut(self._socket)

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already
        pass


class _Watched:
    """A connection whose socket the watchdog holds from the moment it is made (a TLS handshake too)."""

    def __init__(self, *args: object, watchdog: _Watchdog, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = lambda *a, **k: watchdog.watch(socket.create_connection(*a, **k))


class _WatchedConnection(_Watched, http.client.HTTPConnection):
    pass


class _WatchedTLSConnection(_Watched, http.client.HTTPSConnection):
    pass


class _WatchingHandler:
    """A urllib handler that opens its connections watched."""

    def __init__(self, watchdog: _Watchdog) -> None:
        super().__init__()
        self._watchdog = watchdog


class _WatchedHTTP(_WatchingHandler, urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_WatchedConnection, watchdog=self._watchdog), req)


class _WatchedHTTPS(_WatchingHandler, urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_WatchedTLSConnection, watchdog=self._watchdog), req,
                            context=self._context)
