"""return_freed_pages: what a process's malloc kept of the memory it freed goes back to the system, under
glibc's malloc and under jemalloc as the engine core runs it (decay off)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nanoserve.engine.core_client.allocator import CONF, KEEP_FREED_PAGES, PRELOAD, jemalloc_library

# 4096 written blocks of 120 KiB (under glibc's first mmap threshold, so from its heap), every other one
# freed: the holes between the live ones cannot shrink the heap on their own; RSS is read around the call
SCRIPT = """
import ctypes
import psutil
from nanoserve.model.freed_memory import return_freed_pages
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(120 << 10) for _ in range(4096)]
for block in blocks:
    ctypes.memset(block, 1, 120 << 10)
for block in blocks[::2]:
    libc.free(block)
rss = psutil.Process().memory_info().rss
asked = return_freed_pages()
print(asked, (rss - psutil.Process().memory_info().rss) >> 20)
"""


def run_script(env: dict[str, str]) -> tuple[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    asked, returned_mib = result.stdout.split()
    return asked, int(returned_mib)


def test_glibc_returns_the_free_pages_of_its_heap():
    env = {k: v for k, v in os.environ.items() if k not in (PRELOAD, CONF)}
    asked, returned_mib = run_script(env)
    assert asked == "glibc" and returned_mib >= 160


@pytest.mark.skipif(jemalloc_library() is None, reason="no jemalloc library")
def test_jemalloc_with_decay_off_returns_its_freed_pages():
    env = os.environ | {PRELOAD: str(jemalloc_library()), CONF: KEEP_FREED_PAGES}
    asked, returned_mib = run_script(env)
    assert asked == "jemalloc" and returned_mib >= 160
