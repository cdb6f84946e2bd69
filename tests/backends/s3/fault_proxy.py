"""An HTTP proxy in front of the moto server that damages chosen answers: a fault injected at a known request.

``FaultProxy(upstream, rule)`` forwards each request to ``upstream`` and hands the answer to ``rule(method,
headers, status, body)``, which returns the body to send, whether to cut the connection after it, and headers
of the answer to replace; the declared Content-Length stays the real one, so a shorter body is a truncated
answer. ``request(method, headers)`` may rewrite a request's headers first (a store that serves another range);
``chunked(method, headers)`` true sends that answer chunked, without Content-Length. Tests only.
"""

from __future__ import annotations

import http.client
import socketserver
import threading
from collections.abc import Callable

Rule = Callable[[str, dict[str, str], int, bytes], tuple[bytes, bool, dict[str, str]]]
Rewrite = Callable[[str, dict[str, str]], dict[str, str]]
Chunked = Callable[[str, dict[str, str]], bool]


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class FaultProxy:
    def __init__(
        self, upstream: str, rule: Rule, request: Rewrite | None = None, chunked: Chunked | None = None
    ) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream, self.rule = (host, int(port)), rule
        self.request = request or (lambda method, headers: headers)
        self.chunked = chunked or (lambda method, headers: False)
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while proxy._one(self.rfile, self.wfile):
                    pass

        self._server = _Server(("127.0.0.1", 0), Handler)
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _one(self, rfile, wfile) -> bool:
        line = rfile.readline()
        if not line:
            return False
        method, path, _ = line.decode().split(" ", 2)
        headers: list[tuple[str, str]] = []
        while (h := rfile.readline()) not in (b"\r\n", b"\n", b""):
            k, v = h.decode().split(":", 1)
            headers.append((k.strip(), v.strip()))
        named = {k.lower(): v for k, v in headers}
        body = rfile.read(int(named["content-length"])) if "content-length" in named else b""
        up = http.client.HTTPConnection(*self.upstream, timeout=30)
        up.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in self.request(method, dict(headers)).items():
            up.putheader(k, v)
        up.endheaders(body or None)
        answer = up.getresponse()
        data = answer.read()
        dropped = ("content-length", "connection", "transfer-encoding")
        kept = [(k, v) for k, v in answer.getheaders() if k.lower() not in dropped]
        up.close()
        sent, cut, replace = self.rule(method, named, answer.status, data)
        kept = [(k, replace.get(k.lower(), v)) for k, v in kept]
        head = f"HTTP/1.1 {answer.status} {answer.reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in kept)
        if self.chunked(method, named) and method != "HEAD":
            head += "Transfer-Encoding: chunked\r\n"
            step = 64 << 10
            pieces = [sent[i : i + step] for i in range(0, len(sent), step)]
            sent = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in pieces)
            sent += b"0\r\n\r\n"
        else:
            head += f"Content-Length: {len(data)}\r\n"
        head += ("Connection: close\r\n" if cut else "") + "\r\n"
        try:
            wfile.write(head.encode() + (sent if method != "HEAD" else b""))
            wfile.flush()
        except OSError:
            return False
        return not cut

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
