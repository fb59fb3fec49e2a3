"""Test harness: a stand-in scheduler process that serves epdserve's `EPDServe.GenerateStream`
over real gRPC, with no model behind it, so client behaviour (lost schedulers, retries, targets)
is tested in seconds.

`python -m tests.client.token_scheduler PORT TOKEN_DELAY_S` serves on 127.0.0.1:PORT. A request's
tokens are a pure function of its prompt — token i is (len(prompt) * 31 + i) % 997 — one delta per
token, `TOKEN_DELAY_S` apart; `resume_token_ids` must be those tokens' prefix (else
INVALID_ARGUMENT) and the stream continues after them, as the real scheduler's resume does.
`TokenScheduler` runs it as a process the test can SIGKILL and start again on the same port.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

from epdserve.net import free_port


def tokens_for(prompt: str, n: int) -> list[int]:
    return [(len(prompt) * 31 + i) % 997 for i in range(n)]


class TokenScheduler:
    def __init__(self, token_delay_s: float = 0.02, port: int | None = None):
        self.port = port or free_port()
        self.token_delay_s = token_delay_s
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "TokenScheduler":
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.client.token_scheduler", str(self.port),
                                      str(self.token_delay_s)], start_new_session=True, stdout=subprocess.DEVNULL,
                                     cwd=Path(__file__).resolve().parents[2])  # the repository root
        with grpc.insecure_channel(self.address) as ch:
            grpc.channel_ready_future(ch).result(timeout=timeout_s)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> "TokenScheduler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


def _serve(port: int, token_delay_s: float) -> None:
    from epdserve.rpc import serve_pb2, serve_pb2_grpc

    class Servicer(serve_pb2_grpc.EPDServeServicer):
        def GenerateStream(self, req, context):
            want = tokens_for(req.prompt, req.sampling.max_tokens)
            done = list(req.resume_token_ids)
            if done != want[:len(done)] or len(done) >= len(want):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resume_token_ids are not this request's prefix")
            for i in range(len(done), len(want)):
                time.sleep(token_delay_s)
                last = i == len(want) - 1
                yield serve_pb2.GenerateDelta(request_id=req.request_id, token_ids=[want[i]], finished=last,
                                              finish_reason="length" if last else "")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    serve_pb2_grpc.add_EPDServeServicer_to_server(Servicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), float(sys.argv[2]))
