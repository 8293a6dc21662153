"""The engine-core process around `EngineCoreProc`: entry point, stop signals, parent death, exit.

`run_engine_core` is the target of an engine-core child process; `serve_engine_core` is the part a
Ray actor shares with it (build, serve, close in the calling main thread). Exit codes: 0 after a
requested shutdown, 1 after a failure (its death record sent first). If the frontend process dies,
a child process follows it (parent-death signal, plus a thread that notices re-parenting).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from nanoserve import envs
from nanoserve.core.engine_core_proc import EngineCoreProc, EngineCoreProcArgs

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PARENT_POLL_INTERVAL_S = 0.5
"""How often the fallback thread checks that the frontend still exists."""


def die_with_parent(frontend_pid: int) -> None:
    """Exit when the frontend process is gone, even if it was SIGKILLed.

    Our parent is the frontend (spawn, fork) or a forkserver that exits with the frontend. The parent-
    death signal covers the common case at once; a polling thread covers a parent that died before
    prctl took effect, platforms without prctl, and a frontend that is not our direct parent.
    """
    parent_pid = os.getppid()

    def parent_gone() -> bool:
        if os.getppid() != parent_pid:
            return True  # re-parented: our parent has exited
        try:
            os.kill(frontend_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    def on_parent_death_signal(signum: int, frame: Any) -> None:
        # PDEATHSIG also fires when only the *thread* that started us exits: check the process
        if parent_gone():
            os._exit(1)

    if sys.platform.startswith("linux"):
        try:
            signal.signal(signal.SIGUSR1, on_parent_death_signal)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
        except (OSError, AttributeError):
            logger.warning("parent-death signal unavailable; relying on the polling thread")

    def watch_parent() -> None:
        while not parent_gone():
            time.sleep(PARENT_POLL_INTERVAL_S)
        logger.error("engine core: the frontend process %d is gone; exiting", frontend_pid)
        os._exit(1)

    threading.Thread(target=watch_parent, name="EngineCoreParentWatch", daemon=True).start()


def setup_logging(engine_rank: int) -> None:
    """Log lines that name the rank and pid, at NANOSERVE_LOGGING_LEVEL, unless logging is set up already."""
    if logging.getLogger().handlers:
        return
    logging.basicConfig(
        level=envs.logging_level(),
        format=f"(EngineCore_{engine_rank} pid=%(process)d) %(levelname)s %(name)s: %(message)s",
    )


def run_engine_core(args: EngineCoreProcArgs) -> None:
    """Target of the engine-core child process."""
    if args.frontend_pid is not None:
        die_with_parent(args.frontend_pid)
    try:
        from setproctitle import setproctitle

        setproctitle(f"nanoserve::EngineCore_{args.engine_rank}")
    except ImportError:
        pass
    setup_logging(args.engine_rank)
    _exit(serve_engine_core(args, (signal.SIGTERM, signal.SIGINT)))


def serve_engine_core(args: EngineCoreProcArgs, stop_signals: tuple[signal.Signals, ...]) -> int:
    """Build, serve and close one engine core in this (main) thread, for a child process or a Ray actor.

    Returns 0 after a requested shutdown and 1 after a failure (its death record sent). A stop signal
    drains the engine; during the build it abandons it (SystemExit). The handlers are installed before
    the build, so a SIGTERM during weight loading is not lost, and the previous ones restored after.
    """
    proc: EngineCoreProc | None = None

    def on_signal(signum: int, frame: Any) -> None:
        if proc is None or proc.engine is None:
            raise SystemExit(0)
        proc.request_shutdown()

    previous = {signum: signal.signal(signum, on_signal) for signum in stop_signals}
    try:
        proc = EngineCoreProc(args)
        proc.build_engine()
        proc.start_threads()
        proc.run_busy_loop()
    except SystemExit:
        if proc is not None:
            proc.close()
        raise
    except BaseException as e:
        logger.exception("engine core %d failed", args.engine_rank)
        if proc is not None:
            proc.close(death=e)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    proc.close()
    return 0


def _exit(code: int) -> None:
    """Exit without interpreter teardown: the sockets are closed and the output flushed, and what is
    left (daemon I/O threads, OpenMP workers, torch's atexit hooks) can only delay or hang the exit
    that the frontend is waiting on."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
