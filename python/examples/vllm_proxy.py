"""A minimal prefill/decode proxy for vLLM with HandoffConnector (or NixlConnector).

Each completion request goes first to a prefill instance with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``; the ``kv_transfer_params`` in its answer
go, with the original request, to a decode instance, whose answer (streamed or not) is the
client's. Instances are used round-robin. Standard library only.

    python vllm_proxy.py --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

An example, not a production router: no retries, no health checks, no auth.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: Largest request body accepted, so that a client cannot make the proxy buffer without
#: bound.
BODY_BYTES_MAX = 64 << 20
#: Seconds to wait on an instance.
UPSTREAM_TIMEOUT_S = 600


class Upstreams:
    """Round-robin over the instances of one role."""

    def __init__(self, urls: list[str]):
        self._cycle = itertools.cycle(urls)
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            return next(self._cycle)


def make_handler(prefill: Upstreams, decode: Upstreams):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self.send_error(404, "only /v1/completions and /v1/chat/completions")
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length <= 0 or length > BODY_BYTES_MAX:
                self.send_error(400, f"body must be 1..{BODY_BYTES_MAX} bytes")
                return
            try:
                body = json.loads(self.rfile.read(length))
            except json.JSONDecodeError as e:
                self.send_error(400, f"not JSON: {e}")
                return
            first = dict(body, max_tokens=1, stream=False)
            first.pop("max_completion_tokens", None)
            first.pop("stream_options", None)
            first["kv_transfer_params"] = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
            }
            try:
                answer = self._call(prefill.next(), first)
            except urllib.error.HTTPError as e:
                self._relay(e.code, e.read(), e.headers.get("Content-Type"))
                return
            except (urllib.error.URLError, OSError) as e:
                self.send_error(502, f"prefill unreachable: {e}")
                return
            body["kv_transfer_params"] = json.loads(answer).get("kv_transfer_params")
            request = self._request(decode.next(), body)
            try:
                with urllib.request.urlopen(request, timeout=UPSTREAM_TIMEOUT_S) as r:
                    self._stream(r.status, r, r.headers.get("Content-Type"))
            except urllib.error.HTTPError as e:
                self._relay(e.code, e.read(), e.headers.get("Content-Type"))
            except (urllib.error.URLError, OSError) as e:
                self.send_error(502, f"decode unreachable: {e}")

        def _request(self, base: str, body: dict) -> urllib.request.Request:
            return urllib.request.Request(
                base + self.path,
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )

        def _call(self, base: str, body: dict) -> bytes:
            with urllib.request.urlopen(self._request(base, body), timeout=UPSTREAM_TIMEOUT_S) as r:
                return r.read()

        def _relay(self, status: int, data: bytes, ctype: str | None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype or "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, status: int, upstream, ctype: str | None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype or "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := upstream.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", required=True, help="a prefill URL")
    ap.add_argument("--decode", action="append", required=True, help="a decode URL")
    args = ap.parse_args()
    handler = make_handler(Upstreams(args.prefill), Upstreams(args.decode))
    server = ThreadingHTTPServer((args.host, args.port), handler)
    print(f"proxy on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
