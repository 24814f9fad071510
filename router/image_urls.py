"""Images a chat request names by URL: inline `data:` URLs always; `http(s)` URLs only from the hosts the
manifest allows (`server.images.url_hosts`), fetched with bounds.

An open fetcher would let any client make the router request any address it can reach (cloud metadata
services, internal hosts): so a host must be named exactly (with its port, when not the scheme's own),
URLs with user info are refused, and so are redirects (one could lead off
the allowed host), and the body is read against a byte limit and an overall deadline (a server that
drips bytes cannot hold the thread longer). Runs on the router's tokenizer threads, never its event loop.
"""

from __future__ import annotations

import binascii
import http.client
import time
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
        deadline = time.monotonic() + self.timeout_s
        opener = urllib.request.build_opener(_NoRedirects)
        try:
            with opener.open(urllib.request.Request(url, headers={"Accept": "image/*"}), timeout=self.timeout_s) as r:
                declared = r.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise BadParameter("messages", f"the image at {host} has {declared} bytes, more than the "
                                                   f"{self.max_bytes} allowed")
                body = bytearray()
                while chunk := r.read1(CHUNK_BYTES):  # what has arrived: the deadline is checked between
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise BadParameter("messages", f"the image at {host} has more than the {self.max_bytes} "
                                                       "bytes allowed")
                    if time.monotonic() > deadline:
                        raise TimeoutError
                return bytes(body)
        except BadParameter:
            raise
        except urllib.error.HTTPError as e:
            e.close()
            raise BadParameter("messages", f"the image at {host} could not be fetched (HTTP {e.code})") from None
        except (OSError, ValueError, http.client.HTTPException) as e:  # refused, unreachable, timed out, malformed
            raise BadParameter("messages", f"the image at {host} could not be fetched ({type(e).__name__})") from None


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
