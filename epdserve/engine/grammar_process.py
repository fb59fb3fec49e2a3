"""Grammar compiles in a child process of their own, so that a compile over its time budget can be
abandoned: the child is killed (its CPU and its memory go with it) and the next compile starts a
new one. A thread cannot be stopped; xgrammar's compile of a hostile schema can take minutes and
hundreds of MB.

- `CompileProcess(info_json)`: one per engine (GrammarCompiles), started on its first compile as
  `python -m epdserve.engine.grammar_process`, told the vocabulary once (xgrammar's TokenizerInfo
  as JSON); `compile(c, timeout_s)` returns the compiled grammar as xgrammar's JSON, raises
  InvalidRequestError when xgrammar refuses the constraint, or, past `timeout_s`, kills the child
  and raises InvalidRequestError naming `--grammar-compile-timeout-s`. `close()` ends the child.
- The child (`main`): reads frames from stdin, compiles with the engine's own rules
  (engine/grammar.py `compile_constraint`), writes one frame back per compile; it ends when stdin
  ends (the engine closed it or died) or, on Linux, when the thread that started it ends
  (PR_SET_PDEATHSIG).
Frames: a 4-byte big-endian length, then that many bytes of JSON. The child's start (~1.5 s here:
xgrammar imports torch) is not part of a compile's budget.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time

from epdserve.engine.structured_output import StructuredOutput
from epdserve.request_errors import InvalidRequestError

START_TIMEOUT_S = 120.0
TIMEOUT_FLAG = "--grammar-compile-timeout-s"


def _write(stream, obj) -> None:
    data = json.dumps(obj).encode()
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the compile process ended")
        out += chunk
    return bytes(out)


def _read(fd: int):
    (n,) = struct.unpack(">I", _read_exact(fd, 4))
    return json.loads(_read_exact(fd, n))


class CompileProcess:
    """The engine's side of its compile child (see the module docstring)."""

    def __init__(self, info_json: str):
        self._info = info_json
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one compile at a time: the child answers in order
        self.starts = 0  # children started (a timed-out compile costs one)

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-m", "epdserve.engine.grammar_process"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.starts += 1
            _write(self._proc.stdin, {"info": self._info})
            self._await(self._proc, START_TIMEOUT_S, "start")
        return self._proc

    def compile(self, c: StructuredOutput, timeout_s: float) -> str:
        with self._lock:
            return self._compile(c, timeout_s)

    def _compile(self, c: StructuredOutput, timeout_s: float) -> str:
        proc = self._child()
        try:
            _write(proc.stdin, {"kind": c.kind, "spec": c.spec})
        except (BrokenPipeError, OSError):
            self.close()
            raise RuntimeError("the grammar compile process ended") from None
        reply = self._await(proc, timeout_s, c.kind)
        if "error" in reply:
            if reply.get("invalid"):
                raise InvalidRequestError(reply["error"])
            raise RuntimeError(reply["error"])
        return reply["compiled"]

    def _await(self, proc: subprocess.Popen, timeout_s: float, what: str):
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                if what == "start":
                    raise RuntimeError(f"the grammar compile process did not start within {timeout_s:g} s")
                raise InvalidRequestError(
                    f"the {what} structured output did not compile within {timeout_s:g} s ({TIMEOUT_FLAG}): "
                    f"simplify it (fewer enum values or alternatives)")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                try:
                    return _read(fd)
                except EOFError:
                    self.close()
                    raise RuntimeError("the grammar compile process ended during a compile") from None

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
            for s in (proc.stdin, proc.stdout):
                try:
                    s.close()
                except OSError:
                    pass


def _die_with_starter() -> None:
    """Linux: killed when the thread that started this process ends (the engine's compile worker)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> int:
    import xgrammar as xgr

    from epdserve.engine.grammar import compile_constraint

    _die_with_starter()
    fd, out = sys.stdin.fileno(), os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else prints (a library's log) goes to stderr, never into a frame
    try:
        info = xgr.TokenizerInfo.deserialize_json(_read(fd)["info"])
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        _write(out, {"ready": True})
        while True:
            req = _read(fd)
            try:
                compiled = compile_constraint(compiler, StructuredOutput(req["kind"], req["spec"]))
                _write(out, {"compiled": compiled.serialize_json()})
            except InvalidRequestError as e:
                _write(out, {"error": str(e), "invalid": True})
            except Exception as e:  # noqa: BLE001 - reported to the engine, which fails that request alone
                _write(out, {"error": f"the structured output failed to compile: {e!r}"})
    except EOFError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
