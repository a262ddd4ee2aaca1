"""``LocalRedis``: a ``redis-server`` of our own on 127.0.0.1, for tests, benchmarks and demos.

Not for production (there the operator runs Redis): a free port, its own folder, no persistence, no
protected mode; ``kill`` sends SIGKILL as a crash would. Needs Debian's ``redis-server`` binary
(``apt-get install -y redis-server``); ``REDIS_BIN`` is ``None`` where it is missing.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from typing import Optional

REDIS_BIN = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A port whose cluster bus port (+10000) is free too; Redis refuses ports above 55535 in a cluster."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


def _ping(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64)


class LocalRedis:
    """One ``redis-server`` on 127.0.0.1:``port`` with its files in ``workdir``."""

    def __init__(self, workdir: str, port: Optional[int] = None, *extra: str) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.extra = extra
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        os.makedirs(self.workdir, exist_ok=True)
        self.proc = subprocess.Popen(
            [REDIS_BIN or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.workdir,
             "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
             "--logfile", os.path.join(self.workdir, "redis.log"), *self.extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.workdir}/redis.log")
            try:
                if _ping(self.port).startswith(b"+PONG"):
                    return self
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no goodbye to clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
