"""Huge-page buffers (nanoserve.model.huge_pages): the quantized weights' copies and the KV cache, whose
pages the engine writes ahead of its first step."""

from __future__ import annotations

import ctypes
import sys
import threading

import psutil
import pytest
import torch

import nanoserve.model.huge_pages as huge_pages
from nanoserve.config import EngineOptions
from nanoserve.model.huge_pages import (
    HUGE_PAGE,
    MADV_POPULATE_WRITE,
    PAGE,
    PageWriter,
    huge_page_buffer,
    huge_page_copies,
    huge_page_zeros,
    populate,
)
from nanoserve.model.runner import ModelRunner
from tests.core.engine_steps import hf_greedy, make_prompts, request, run_to_completion, tiny_engine


def thp_mode() -> str:
    """The bracketed choice in /sys/kernel/mm/transparent_hugepage/enabled ("" where there is none)."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return ""
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else ""


def resident_fraction(tensor: torch.Tensor) -> float:
    """The share of the pages under a CPU tensor that are in memory (mincore(2))."""
    start = tensor.data_ptr() // PAGE * PAGE
    pages = (tensor.data_ptr() + tensor.nbytes - start + PAGE - 1) // PAGE
    flags = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), flags) == 0, ctypes.get_errno()
    return sum(flag & 1 for flag in flags) / pages


def test_huge_page_copies_are_equal_views_of_one_aligned_buffer():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.uint8), torch.randn(300, 576).half()]
    copies, advised = huge_page_copies(tensors)
    assert all(torch.equal(c, t) and c.dtype == t.dtype for c, t in zip(copies, tensors, strict=True))
    storages = {c.untyped_storage().data_ptr() for c in copies}
    assert len(storages) == 1 and all(c.data_ptr() % 64 == 0 for c in copies)
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    assert advised == (sys.platform == "linux" and thp_mode() in ("always", "madvise"))


@pytest.mark.parametrize("nbytes", [4096, 345_000, HUGE_PAGE, 3 * HUGE_PAGE + 5])
def test_huge_page_advice_stays_inside_the_buffer_mapping(monkeypatch, nbytes):
    """The advised range starts on the first 2 MiB boundary of the mapping and spans whole huge pages: a
    mapping only 2 MiB longer than the buffer ended before it (for 4096 bytes, unless the mapping began
    within 4 KiB of a boundary), so that the advice failed or landed on a neighbouring mapping."""
    advised = []
    monkeypatch.setattr(
        huge_pages, "madvise", lambda address, length, advice: advised.append((address, length)) or True
    )
    buffer = huge_page_buffer(nbytes)
    storage = buffer.data.untyped_storage()
    ((address, length),) = advised
    assert address % HUGE_PAGE == 0 and length % HUGE_PAGE == 0
    assert address <= buffer.data.data_ptr() and buffer.data.data_ptr() + nbytes <= address + length
    assert storage.data_ptr() <= address and address + length <= storage.data_ptr() + storage.nbytes()


def test_huge_page_zeros_are_separate_zeroed_tensors_of_one_buffer():
    caches, _ = huge_page_zeros(3, (2, 3, 5, 16, 8), torch.bfloat16)
    assert all(c.shape == (2, 3, 5, 16, 8) and c.dtype == torch.bfloat16 and not c.any() for c in caches)
    caches[1].fill_(1)
    assert not caches[0].any() and not caches[2].any() and caches[1].all()
    assert len({c.untyped_storage().data_ptr() for c in caches}) == 1


def test_huge_page_zeros_are_carved_from_a_buffer_where_they_fit():
    buffer = huge_page_buffer(4 << 20)
    caches, advised = huge_page_zeros(3, (2, 4, 64, 16, 8), torch.float32, within=buffer)  # 256 KiB each
    assert caches[0].data_ptr() == buffer.data.data_ptr() and advised == buffer.advised
    assert all(c.data_ptr() % 64 == 0 and not c.any() for c in caches)
    too_many, _ = huge_page_zeros(20, (2, 4, 64, 16, 8), torch.float32, within=buffer)
    assert too_many[0].untyped_storage().data_ptr() != buffer.data.untyped_storage().data_ptr()


def test_huge_page_zeros_take_memory_only_where_written():
    """Fresh pages are the kernel's zeros: allocating 256 MiB touches none of them, and a layer takes its
    memory when it is written."""
    process = psutil.Process()
    before = process.memory_info().rss
    caches, _ = huge_page_zeros(8, (2, 4, 1024, 16, 64), torch.float32)  # 32 MiB a layer
    assert process.memory_info().rss - before < 16 << 20
    caches[3].fill_(1.0)
    assert process.memory_info().rss - before > 28 << 20
    assert not caches[2].any() and not caches[4].any()


def anon_huge_pages() -> int:
    """Bytes of this process's anonymous memory backed by transparent huge pages."""
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) << 10 for line in rollup if line.startswith("AnonHugePages:"))


@pytest.mark.skipif(
    sys.platform != "linux" or thp_mode() not in ("always", "madvise"), reason="no transparent huge pages"
)
def test_huge_page_zeros_are_backed_by_huge_pages_once_written():
    """The buffer is private anonymous memory, which follows the madvise mode: a shared anonymous mapping is
    shmem, which got no huge pages at all under the default shmem_enabled=never."""
    before = anon_huge_pages()
    caches, advised = huge_page_zeros(4, (2, 4, 1024, 16, 64), torch.float32)  # 128 MiB
    for cache in caches:
        cache.fill_(1.0)
    assert advised and anon_huge_pages() - before >= 2 << 20  # at least one 2 MiB page, however fragmented


@pytest.mark.parametrize("madvise_works", [True, False])
def test_populate_brings_every_page_in_and_keeps_the_values(madvise_works, monkeypatch):
    buffer = huge_page_buffer(24 << 20)
    if madvise_works and not huge_pages.madvise(buffer.data.data_ptr(), PAGE, MADV_POPULATE_WRITE):
        pytest.skip("no MADV_POPULATE_WRITE here (Linux before 5.14)")
    if not madvise_works:  # one element a page is written with its own value
        monkeypatch.setattr(huge_pages, "madvise", lambda address, length, advice: False)
    values = torch.arange(1000, dtype=torch.float32)
    buffer.data[5 << 20 : (5 << 20) + 4000].view(torch.float32).copy_(values)
    assert resident_fraction(buffer.data) < 0.5
    populate([buffer.data[: 12 << 20], buffer.data[12 << 20 :]])
    assert resident_fraction(buffer.data) == 1.0
    assert torch.equal(buffer.data[5 << 20 : (5 << 20) + 4000].view(torch.float32), values)
    assert not buffer.data[: 5 << 20].any() and not buffer.data[(5 << 20) + 4000 :].any()


def test_a_page_writer_writes_on_its_thread_and_a_stopped_one_gives_up():
    buffer = huge_page_buffer(16 << 20)
    writer = PageWriter([buffer.data])
    writer.join()
    assert resident_fraction(buffer.data) == 1.0
    untouched = huge_page_buffer(16 << 20)
    stop = threading.Event()
    stop.set()
    populate([untouched.data], stop)
    assert resident_fraction(untouched.data) == 0.0


def test_the_engine_starts_with_its_kv_cache_in_memory(tiny_gqa_dir):
    """Sized from its budget, the cache is carved from the buffer the runner took before reading the
    model, every page written while the weights loaded; after a sleep that dropped it, the new cache is
    written again before the engine serves."""
    prompt = make_prompts(1, seed=4)[0]
    engine = tiny_engine(tiny_gqa_dir, num_kv_blocks=None, kv_cache_memory_bytes=8 << 20)
    caches = engine.runner.kv_caches
    assert len({c.untyped_storage().data_ptr() for c in caches}) == 1
    # the reserved buffer: the budget, its slack and the mapping's room to align
    assert caches[0].untyped_storage().nbytes() == (8 << 20) + 2 * HUGE_PAGE
    assert all(resident_fraction(c) == 1.0 and not c.any() for c in caches)
    engine.add_request(request("a", prompt))
    assert run_to_completion(engine)["a"][0] == hf_greedy(tiny_gqa_dir, [prompt])[0]
    engine.call_utility("sleep", (2, "abort"))
    engine.call_utility("wake_up", ())
    assert all(resident_fraction(c) == 1.0 and not c.any() for c in engine.runner.kv_caches)
    engine.add_request(request("b", prompt))
    assert run_to_completion(engine)["b"][0] == hf_greedy(tiny_gqa_dir, [prompt])[0]


def test_a_runner_that_fails_to_read_its_model_stops_writing_its_kv_cache(tmp_path):
    """The default GiB is reserved and being written before the config is read; a file that is no model
    stops the writer at once instead of leaving it to write (and hold) the rest."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ValueError):
        ModelRunner(EngineOptions(model=str(broken)))
    assert not [t for t in threading.enumerate() if t.name == "populate" and t.is_alive()]
