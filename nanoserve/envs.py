"""Every NANOSERVE_* environment variable, read here and nowhere else.

Each is read when asked for (not at import), so a test or a launcher that sets one before starting an
engine is seen. Options that users pass explicitly live in `EngineOptions`; these are the knobs that
must reach places no option reaches (a child process's logging, a build cache) or that deployments set
once for every command.
"""

from __future__ import annotations

import os
from pathlib import Path

ENABLE_MULTIPROCESSING = "NANOSERVE_ENABLE_MULTIPROCESSING"
ENGINE_READY_TIMEOUT_S = "NANOSERVE_ENGINE_READY_TIMEOUT_S"
MSGPACK_ZERO_COPY_THRESHOLD = "NANOSERVE_MSGPACK_ZERO_COPY_THRESHOLD"
LOGGING_LEVEL = "NANOSERVE_LOGGING_LEVEL"
TORCH_PROFILER_DIR = "NANOSERVE_TORCH_PROFILER_DIR"
KERNEL_DIR = "NANOSERVE_KERNEL_DIR"
KERNEL_ARCH = "NANOSERVE_KERNEL_ARCH"
API_KEY = "NANOSERVE_API_KEY"

PREFIX = "NANOSERVE_"
FRONTEND_ONLY = (API_KEY,)
"""Read by the frontend alone, and never sent to engines on other machines (the API key is a secret)."""

DEFAULT_ENGINE_READY_TIMEOUT_S = 600.0
"""Spawn, imports, weight loading and KV sizing of the slowest engine, under one deadline."""


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off", "")


def enable_multiprocessing() -> bool:
    """Default of `EngineOptions.multiprocess_mode`: 0 keeps the engine core in the frontend's process."""
    return _flag(ENABLE_MULTIPROCESSING, True)


def engine_ready_timeout_s() -> float:
    """How long the frontend waits for an engine core to report ready (first start and restarts)."""
    return float(os.environ.get(ENGINE_READY_TIMEOUT_S, DEFAULT_ENGINE_READY_TIMEOUT_S))


def msgpack_zero_copy_threshold() -> int:
    """Arrays of at least this many bytes travel as separate zero-copy frames."""
    return int(os.environ.get(MSGPACK_ZERO_COPY_THRESHOLD, "256"))


def logging_level() -> str:
    """The log level of engine-core processes (they configure their own logging)."""
    return os.environ.get(LOGGING_LEVEL, "INFO").upper()


def torch_profiler_dir() -> str:
    """Where the engine's `profile` utility writes its traces."""
    return os.environ.get(TORCH_PROFILER_DIR, "profiles")


def kernel_dir() -> Path:
    """The build cache of the C++ CPU kernels."""
    return Path(os.environ.get(KERNEL_DIR) or Path.home() / ".cache" / "nanoserve" / "kernels")


def kernel_arch() -> str:
    """The GCC -march the C++ CPU kernels are built for: native (this CPU), or an older target that this
    CPU also runs, so that one machine can test the code paths of another (tests/other_cpus.py)."""
    return os.environ.get(KERNEL_ARCH) or "native"


def api_key() -> str | None:
    """The server's bearer token when --api-key is not given (also the benchmark client's default)."""
    return os.environ.get(API_KEY) or None


def forwarded_to_engines() -> dict[str, str]:
    """The NANOSERVE_* variables set here that an engine started elsewhere (a Ray actor, whose
    environment is its node's) must see as a child process would."""
    return {k: v for k, v in os.environ.items() if k.startswith(PREFIX) and k not in FRONTEND_ONLY}
