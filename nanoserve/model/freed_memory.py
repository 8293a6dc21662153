"""Handing back to the system the pages that loading a model freed.

Loading allocates and frees hundreds of MB of temporaries: dequantized GGUF tensors, weights before
their packed and huge-page copies replaced them, packed twins that no step reads. The engine core runs on
jemalloc with its decay off (nanoserve.engine.core_client.allocator), which keeps every freed page for
good so that steps never fault their buffers back in, and glibc's malloc keeps the free pages inside its
heap. Once loading is done, one call asks either to return them: on the bundled model with int4, 126 MiB
of jemalloc's, and 215 more once the unread packed twins were dropped. The pages of the start-up
measurements' step buffers go with them, and the first steps fault those back in once.
"""

from __future__ import annotations

import ctypes

MALLCTL_ARENAS_ALL = 4096
"""jemalloc's index for "every arena" in mallctl names."""


def return_freed_pages() -> str | None:
    """Ask this process's malloc to return its free pages to the system; which one was asked ("jemalloc",
    "glibc"), or None where neither is there to ask."""
    libc = ctypes.CDLL(None)
    mallctl = getattr(libc, "mallctl", None)
    if mallctl is not None:
        name = f"arena.{MALLCTL_ARENAS_ALL}.purge".encode()
        return "jemalloc" if mallctl(name, None, None, None, ctypes.c_size_t(0)) == 0 else None
    malloc_trim = getattr(libc, "malloc_trim", None)
    if malloc_trim is None:
        return None
    malloc_trim(ctypes.c_size_t(0))
    return "glibc"
