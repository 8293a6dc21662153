"""`nanoserve serve` in a subprocess for the tests that drive a real server (the OpenAI surface, the web
page): started on a free port, waited on until /health answers, and killed with every process it started;
and helpers to read a server from outside (its Prometheus metrics, a condition to wait for)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

STARTUP_TIMEOUT_S = 120
API_KEY = "test-key"
"""The key of the servers tests start with --api-key."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir: Path, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", "--model", str(model_dir)]
        cmd += ["--dtype", "float32", "--port", str(self.port), "--max-model-len", "512", *extra]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.wait_healthy()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy within {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def engine_pids(self) -> dict[int, int]:
        """Engine rank -> pid of its engine-core process."""
        pids = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            match = re.search(r"EngineCore_(\d+)", " ".join(child.cmdline()))
            if match:
                pids[int(match[1])] = child.pid
        return pids

    def engine_pid(self) -> int:
        pids = self.engine_pids()
        assert pids, "no engine core child found"
        return pids[min(pids)]

    def stop(self) -> None:
        """Kill the server and every process it started (they share its session)."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(children, timeout=10)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
