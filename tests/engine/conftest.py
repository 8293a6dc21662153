"""Fail any test that leaves a child process of the test process behind."""

from __future__ import annotations

import time

import psutil
import pytest

LEAK_GRACE_S = 5.0


def _children() -> dict[int, psutil.Process]:
    # multiprocessing's resource tracker / forkserver helpers live for the whole session: not leaks
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if "resource_tracker" in cmdline or "forkserver" in cmdline:
            continue
        found[child.pid] = child
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(autouse=True)
def no_leaked_processes():
    before = set(_children())
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    leaked = {}
    while time.monotonic() < deadline:
        leaked = {pid: p for pid, p in _children().items() if pid not in before and _alive(p)}
        if not leaked:
            return
        time.sleep(0.1)
    for proc in leaked.values():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    pytest.fail(f"test left child process(es) behind: {sorted(leaked)}")
