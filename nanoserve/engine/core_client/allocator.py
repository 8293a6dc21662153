"""Which malloc an engine-core process runs on.

A prefill step allocates a dozen buffers of 0.5-3 MB a layer (matmul outputs, activations, the attention
kernel's packed keys) and frees them a kernel later. glibc's malloc serves them from its large bins,
searching and coalescing on the main thread while the other OpenMP threads wait, and hands back whichever
chunk fits, often one that has left the caches. jemalloc keeps a free list per size class and reuses the
chunk just freed. On a two-core AMX Xeon, the bundled model's 512-token int4 prefill took a median 89.2 ms
under jemalloc against 103.6 ms (`bench peers`, 6 prompts each), and 91.0-92.9 against 96.8-97.4 in two
alternating pairs of 31 prompts. vLLM's CPU backend asks its users to preload tcmalloc or jemalloc for the
same reason.

A process picks its malloc when it starts, so the engine-core process is started with jemalloc in
LD_PRELOAD: only a `spawn`ed child execs afresh (a forked one keeps its parent's malloc). jemalloc's
own default hands freed pages back to the system over the following seconds, on the allocating thread,
and the next step faults them back in: at batch 64 (int4, an engine per run) it decoded 1664 tok/s
against glibc's 1845, and 1904 and 1914 with that decay off (against 1845 and 1784), which MALLOC_CONF
does unless the user set their own.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import functools
import os
import threading
from collections.abc import Generator

from nanoserve.config import EngineOptions

PRELOAD = "LD_PRELOAD"
CONF = "MALLOC_CONF"
KEEP_FREED_PAGES = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
_ENVIRON_LOCK = threading.Lock()


@functools.cache
def jemalloc_library() -> str | None:
    """jemalloc's shared library as the dynamic loader finds it (Debian: libjemalloc2), or None. Looked
    up once: find_library runs `ldconfig -p`, and every engine start and restart asks."""
    return ctypes.util.find_library("jemalloc")


def engine_preload(options: EngineOptions) -> str | None:
    """The library an engine-core process preloads: jemalloc with engine_allocator "jemalloc" (an error
    where it is missing), or with "auto" where it is found and the process is spawned and no LD_PRELOAD
    is set already; None for "system"."""
    if options.engine_allocator == "system":
        return None
    library = jemalloc_library()
    if options.engine_allocator == "jemalloc":
        if library is None:
            raise RuntimeError(
                "engine_allocator='jemalloc', but no jemalloc library was found (Debian: apt-get install "
                "libjemalloc2; `make setup` installs it)"
            )
        return library
    if library is None or options.engine_start_method != "spawn" or os.environ.get(PRELOAD):
        return None
    return library


@contextlib.contextmanager
def preloaded(library: str | None) -> Generator[None]:
    """LD_PRELOAD set to `library` (and MALLOC_CONF to KEEP_FREED_PAGES, unless set) in this process's
    environment while a child is started (a spawned child copies the environment as it execs), then
    both restored."""
    if library is None:
        yield
        return
    with _ENVIRON_LOCK:
        saved = {name: os.environ.get(name) for name in (PRELOAD, CONF)}
        os.environ[PRELOAD] = library
        os.environ.setdefault(CONF, KEEP_FREED_PAGES)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
