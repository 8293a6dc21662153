"""Tensors in 2 MiB pages (Linux transparent huge pages): the weights a decode step streams, the KV cache.

A decode step at batch 1 reads every quantized weight once, about 100 MB for SmolLM2-135M, and with
4 KiB pages that is a TLB miss every 4 KiB, tens of thousands per step; decode attention reads 2 KiB
blocks scattered over a cache of a GiB, nearly a miss per block. Laid side by side in one buffer that
the kernel is asked to back with 2 MiB pages (madvise MADV_HUGEPAGE, honoured where
/sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise"), the same bytes take 512 times
fewer pages. Apart, most of the weights are too small to fill an aligned 2 MiB page.

The buffer is a fresh private anonymous mapping, whose pages the kernel fills with zeros when they are
first touched, and the whole buffer goes back to the system when its tensors are freed. A page first
touched inside a step costs that step a fault, and under a hypervisor a dear one: on a two-core AMD Zen 5
VM, a fresh engine's 512-token prompts took 184 ms to the first token with the KV cache's pages faulted
in by the prompts' own writes (160 ms in 4 KiB pages) and 130 ms with every page written before, where
writing a GiB took 2.6 s in huge pages (0.35 s in 4 KiB ones). So the engine writes the KV cache's pages
ahead (`PageWriter`) while it reads the model's config.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
PAGE = mmap.PAGESIZE
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
"""Linux 5.14 and later: fault every page of a range in for writing, without changing its contents."""
POPULATE_CHUNK = HUGE_PAGE
"""Pages faulted in per call: each call holds the process's memory-map lock, which the other threads'
mmap and munmap wait on."""
ALIGNMENT = 64
"""Each copy starts on a cache line."""


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def madvise(address: int, length: int, advice: int) -> bool:
    """madvise(2) over [address, address + length) (address page-aligned); False where it fails."""
    if sys.platform != "linux" or length <= 0:
        return False
    libc = _libc()
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) != 0:
        logger.debug("madvise(%d) failed: errno %d", advice, ctypes.get_errno())
        return False
    return True


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask for [address, address + length) to be backed by huge pages (page-aligned); False where it cannot."""
    return madvise(address, length, MADV_HUGEPAGE)


def populate(tensors: Sequence[Tensor], stop: threading.Event | None = None) -> None:
    """Fault in every page of these CPU tensors for writing, their values unchanged: with
    MADV_POPULATE_WRITE where the kernel has it (the GIL released), else by writing one element a page
    with its own value. stop: checked between calls, to give up early."""
    began = time.perf_counter()
    for tensor in tensors:
        start, end = tensor.data_ptr() // PAGE * PAGE, tensor.data_ptr() + tensor.nbytes
        for chunk in range(start, end, POPULATE_CHUNK):
            if stop is not None and stop.is_set():
                return
            if not madvise(chunk, min(POPULATE_CHUNK, end - chunk), MADV_POPULATE_WRITE):
                flat = tensor.view(-1).view(torch.uint8)
                flat[::PAGE].add_(0)
                flat[-1:].add_(0)
                break
    megabytes = sum(t.nbytes for t in tensors) / 2**20
    logger.debug("wrote the pages of %.0f MiB in %.2f s", megabytes, time.perf_counter() - began)


class PageWriter:
    """populate(tensors) on a daemon thread, from construction on (the kernel zeroes a page on the thread
    that faults it in); join it before the pages are needed."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=populate, args=(list(tensors), self._stop), name="populate")
        self._thread.daemon = True
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def stop(self) -> None:
        """Give up after the current call (2 MiB) and wait for that."""
        self._stop.set()
        self._thread.join()


def _aligned(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def span(nbytes: Sequence[int]) -> int:
    """The bytes that views of these sizes take side by side in a buffer (carve_views)."""
    return sum(_aligned(n, ALIGNMENT) for n in nbytes)


@dataclass
class HugePageBuffer:
    """A zero buffer in a fresh mapping, starting on a 2 MiB boundary and advised to huge pages before
    anything touched it. Views of it hold the mapping: it is unmapped when the last of them is freed."""

    data: Tensor
    """uint8"""
    advised: bool
    """Whether the huge-page advice was taken."""


def huge_page_buffer(nbytes: int) -> HugePageBuffer:
    # private: a shared anonymous mapping is shmem, whose huge pages /sys/kernel/mm/transparent_hugepage/
    # shmem_enabled governs ("never" by default), not the madvise mode that anonymous memory follows
    # whole 2 MiB pages from the first boundary in it: the advice must not reach past the mapping (where
    # it fails, or lands on a neighbour's memory)
    pages = _aligned(nbytes, HUGE_PAGE)
    mapping = mmap.mmap(-1, pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = _aligned(whole.data_ptr(), HUGE_PAGE) - whole.data_ptr()
    advised = advise_huge_pages(whole.data_ptr() + start, pages)
    return HugePageBuffer(whole[start : start + nbytes], advised)


def carve_views(buffer: Tensor, nbytes: Sequence[int]) -> list[Tensor]:
    """uint8 views of these sizes side by side from buffer's start, each on a cache line."""
    views, offset = [], 0
    for n in nbytes:
        views.append(buffer[offset : offset + n])
        offset += _aligned(n, ALIGNMENT)
    if offset > buffer.nbytes:
        raise ValueError(f"views of {offset} bytes do not fit in a buffer of {buffer.nbytes}")
    return views


def huge_page_views(nbytes: Sequence[int]) -> tuple[list[Tensor], bool]:
    """Zero uint8 tensors of these sizes, side by side in one huge_page_buffer; returns them and whether
    the huge-page advice was taken."""
    buffer = huge_page_buffer(span(nbytes))
    return carve_views(buffer.data, nbytes), buffer.advised


def huge_page_copies(tensors: Sequence[Tensor]) -> tuple[list[Tensor], bool]:
    """Copies of CPU tensors in one huge-page buffer (huge_page_views)."""
    views, advised = huge_page_views([t.nbytes for t in tensors])
    copies = [v.view(t.dtype).view(t.shape).copy_(t) for v, t in zip(views, tensors, strict=True)]
    return copies, advised


def huge_page_zeros(
    count: int, shape: tuple[int, ...], dtype: torch.dtype, within: HugePageBuffer | None = None
) -> tuple[list[Tensor], bool]:
    """count zero tensors of one shape in one huge-page buffer (huge_page_views), none of it touched by
    this call; within: a buffer to carve them from instead where they fit (its pages perhaps being
    written ahead, see populate)."""
    nbytes = [dtype.itemsize * int(torch.Size(shape).numel())] * count
    if within is not None and span(nbytes) <= within.data.nbytes:
        views, advised = carve_views(within.data, nbytes), within.advised
    else:
        views, advised = huge_page_views(nbytes)
    return [v.view(dtype).view(shape) for v in views], advised
