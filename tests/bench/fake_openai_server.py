"""A stand-in OpenAI-compatible streaming server for the peer-comparison tests (stdlib only).

`python tests/bench/fake_openai_server.py --port P [--ttft-ms T] [--itl-ms I]` serves /health,
/v1/models and streaming /v1/chat/completions: T ms after a request arrives the first content
chunk, then one per I ms up to max_completion_tokens, finish_reason "length", a usage chunk and
[DONE]. Refuses vLLM's extra fields (ignore_eos, return_token_ids) as `transformers serve` does.
"""
from __future__ import annotations

import argparse
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def handler(ttft_s: float, itl_s: float):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _json(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0,
                                                             "owned_by": "test"}]})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/v1/chat/completions":
                return self._json(404, {"error": "not found"})
            if "ignore_eos" in body or "return_token_ids" in body:
                return self._json(422, {"error": "unknown field"})
            n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 1)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()

            def send(choices, usage=None):
                chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                         "choices": choices, "usage": usage}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()

            time.sleep(ttft_s)
            for i in range(n):
                if i:
                    time.sleep(itl_s)
                send([{"index": 0, "delta": {"content": "a"}, "finish_reason": None}])
            send([{"index": 0, "delta": {}, "finish_reason": "length"}])
            send([], {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    a = ap.parse_args()
    ThreadingHTTPServer(("127.0.0.1", a.port), handler(a.ttft_ms / 1e3, a.itl_ms / 1e3)).serve_forever()


if __name__ == "__main__":
    main()
