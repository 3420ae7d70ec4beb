"""Running the roles as real processes on this machine (demo and end-to-end tests)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


def child_env(threads: int = 1) -> dict[str, str]:
    """Environment for a node process: one compute thread each, so N nodes share the cores."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "PYTHONUNBUFFERED": "1"})
    return env


@dataclass
class LocalProcesses:
    """Processes started for one swarm; all are stopped by :meth:`stop_all`."""

    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _logs: list[IO[bytes]] = field(default_factory=list)

    def start(self, name: str, args: list[str], threads: int = 1) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop_all)
        self._logs.append(log)
        proc = subprocess.Popen([sys.executable, "-m", "veritrain.cli", *args], stdout=log,
                                stderr=subprocess.STDOUT, env=child_env(threads))
        self.procs[name] = proc
        return proc

    def start_ledger(self, data_dir: Path, *, timeout: float = 60.0, port: int = 0,
                     extra: list[str] | None = None) -> str:
        """Start ``veritrain ledger serve`` (port 0: any free one); returns its URL once it listens."""
        ready = data_dir.with_name(data_dir.name + ".ready")
        ready.unlink(missing_ok=True)
        proc = self.start("ledger", ["ledger", "serve", "--data-dir", str(data_dir), "--port",
                                     str(port), "--ready-file", str(ready), *(extra or [])])
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"ledger exited with {proc.returncode}; see {self.log_dir}")
            if time.monotonic() > deadline:
                raise TimeoutError("ledger did not start in time")
            time.sleep(0.05)
        return str(json.loads(ready.read_text())["url"])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(timeout=30)

    def stop_all(self, timeout: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()


def free_port() -> int:
    """A loopback TCP port that is free right now (for a server that must keep its port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
