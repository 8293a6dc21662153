"""Tensors in 2 MiB pages (Linux transparent huge pages): the weights a decode step streams, the KV cache.

A decode step at batch 1 reads every quantized weight once, about 100 MB for SmolLM2-135M, and with
4 KiB pages that is a TLB miss every 4 KiB, tens of thousands per step; decode attention reads 2 KiB
blocks scattered over a cache of a GiB, nearly a miss per block. Laid side by side in one buffer that
the kernel is asked to back with 2 MiB pages (madvise MADV_HUGEPAGE, honoured where
/sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise"), the same bytes take 512 times
fewer pages. Apart, most of the weights are too small to fill an aligned 2 MiB page.

The buffer is a fresh private anonymous mapping, whose pages the kernel fills with zeros when they are
first touched: a KV cache is zero without a pass over it (a GiB took 1.4 s at start on an AMD Zen 5)
and takes memory only as its blocks are first written, and the whole buffer goes back to the system
when its tensors are freed.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
ALIGNMENT = 64
"""Each copy starts on a cache line."""


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask for [address, address + length) to be backed by huge pages (page-aligned); False where it cannot."""
    if sys.platform != "linux" or length <= 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return False
    return True


def _aligned(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def huge_page_views(nbytes: Sequence[int]) -> tuple[list[Tensor], bool]:
    """Zero uint8 tensors of these sizes, side by side in one fresh mapping that starts on a 2 MiB
    boundary and is advised to huge pages before anything touches it; returns them and whether the
    advice was taken. The tensors hold the mapping: it is unmapped when the last of them is freed."""
    sizes = [_aligned(n, ALIGNMENT) for n in nbytes]
    # private: a shared anonymous mapping is shmem, whose huge pages /sys/kernel/mm/transparent_hugepage/
    # shmem_enabled governs ("never" by default), not the madvise mode that anonymous memory follows
    mapping = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    start = _aligned(buffer.data_ptr(), HUGE_PAGE) - buffer.data_ptr()
    advised = advise_huge_pages(buffer.data_ptr() + start, _aligned(sum(sizes), HUGE_PAGE))
    views, offset = [], start
    for n, size in zip(nbytes, sizes, strict=True):
        views.append(buffer[offset : offset + n])
        offset += size
    return views, advised


def huge_page_copies(tensors: Sequence[Tensor]) -> tuple[list[Tensor], bool]:
    """Copies of CPU tensors in one huge-page buffer (huge_page_views)."""
    views, advised = huge_page_views([t.nbytes for t in tensors])
    copies = [v.view(t.dtype).view(t.shape).copy_(t) for v, t in zip(views, tensors, strict=True)]
    return copies, advised


def huge_page_zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[list[Tensor], bool]:
    """count zero tensors of one shape in one huge-page buffer (huge_page_views), none of it touched."""
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    views, advised = huge_page_views([nbytes] * count)
    return [v.view(dtype).view(shape) for v in views], advised
