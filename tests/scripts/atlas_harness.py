"""Runs scripts/atlas_node.sh for real on loopback (DEVICE=cpu): `Node` is one run of it in its own
session, `script_env` the settings that put the scripts' configuration on 127.0.0.1."""

import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "atlas_node.sh"
SECRET_ENV = ("EPDSERVE_CLUSTER_TOKEN", "EPDSERVE_API_KEY", "EPDSERVE_MM_STORE_PASSWORD", "EPDSERVE_MM_STORE_USERNAME")


def script_env(model, sched_port: int, reg_port: int, mm_store: str, **extra: str) -> dict:
    """This process's environment without any secret, `epdserve` on PATH, and the scripts'
    settings for one CPU server on loopback."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}", DEVICE="cpu",
               NODE_IP="127.0.0.1", HEAD_IP="127.0.0.1", NIC="lo", MODEL=str(model), SCHED_PORT=str(sched_port),
               REG_PORT=str(reg_port), MM_STORE=mm_store, KV_CACHE_MB="16", PYTHONUNBUFFERED="1", **extra)
    return env


def loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback  # gRPC listens on ::ffff:127.0.0.1


class Node:
    """One `atlas_node.sh` run in its own session, its output collected line by line."""

    def __init__(self, args, env):
        self.proc = subprocess.Popen(["bash", str(SCRIPT), *args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float = 240):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            assert self.proc.poll() is None, f"atlas_node.sh exited {self.proc.returncode}:\n{''.join(self.lines)}"
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} within {timeout_s} s:\n{''.join(self.lines[-40:])}")

    def processes(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def stop(self):
        """SIGTERM, as the ssh session closing does: the script's trap stops what it started."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
