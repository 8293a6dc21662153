"""The engine-core process's malloc: jemalloc preloaded where asked for or found, the frontend's own
environment left as it was, and refusals that name the option."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client import allocator
from nanoserve.engine.core_client.sync_mp import SyncMPClient

needs_jemalloc = pytest.mark.skipif(
    allocator.jemalloc_library() is None, reason="libjemalloc2 is not installed (make install-jemalloc)"
)


def mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def engine_maps(options: EngineOptions) -> str:
    client = SyncMPClient(options)
    try:
        return mapped_libraries(client.engine_pids()[0])
    finally:
        client.shutdown()


@needs_jemalloc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("choice", ["auto", "jemalloc"])
def test_the_engine_runs_on_jemalloc_and_the_frontend_keeps_its_environment(choice, monkeypatch):
    monkeypatch.delenv(allocator.PRELOAD, raising=False)
    monkeypatch.delenv(allocator.CONF, raising=False)
    assert "libjemalloc" in engine_maps(EngineOptions(runner="null", engine_allocator=choice))
    assert allocator.PRELOAD not in os.environ and allocator.CONF not in os.environ
    assert "libjemalloc" not in mapped_libraries(os.getpid())


@pytest.mark.timeout(120)
def test_system_keeps_the_c_librarys_malloc(monkeypatch):
    monkeypatch.delenv(allocator.PRELOAD, raising=False)
    assert "libjemalloc" not in engine_maps(EngineOptions(runner="null", engine_allocator="system"))


def test_auto_leaves_a_users_preload_and_forked_engines_alone(monkeypatch):
    monkeypatch.setattr(allocator, "jemalloc_library", lambda: "libjemalloc.so.2")
    monkeypatch.delenv(allocator.PRELOAD, raising=False)
    assert allocator.engine_preload(EngineOptions(runner="null")) == "libjemalloc.so.2"
    assert allocator.engine_preload(EngineOptions(runner="null", engine_start_method="fork")) is None
    monkeypatch.setenv(allocator.PRELOAD, "libtcmalloc.so.4")
    assert allocator.engine_preload(EngineOptions(runner="null")) is None
    assert (
        allocator.engine_preload(EngineOptions(runner="null", engine_allocator="jemalloc"))
        == "libjemalloc.so.2"
    )


def test_a_missing_jemalloc_is_an_error_only_when_asked_for(monkeypatch):
    monkeypatch.setattr(allocator, "jemalloc_library", lambda: None)
    monkeypatch.delenv(allocator.PRELOAD, raising=False)
    assert allocator.engine_preload(EngineOptions(runner="null")) is None
    with pytest.raises(RuntimeError, match="engine_allocator='jemalloc'.*libjemalloc2"):
        allocator.engine_preload(EngineOptions(runner="null", engine_allocator="jemalloc"))


@pytest.mark.parametrize(
    "fields",
    [
        {"multiprocess_mode": False},
        {"engine_start_method": "fork"},
        {"engine_start_method": "forkserver"},
    ],
)
def test_jemalloc_is_refused_where_no_engine_process_is_spawned(fields):
    with pytest.raises(ValueError, match="engine_allocator='jemalloc' needs"):
        EngineOptions(engine_allocator="jemalloc", **fields)


def test_an_unknown_allocator_is_refused():
    with pytest.raises(ValueError, match="engine_allocator must be one of"):
        EngineOptions(engine_allocator="tcmalloc")


def test_a_start_keeps_freed_pages_unless_the_user_configured_jemalloc(monkeypatch):
    monkeypatch.delenv(allocator.PRELOAD, raising=False)
    monkeypatch.delenv(allocator.CONF, raising=False)
    with allocator.preloaded("libjemalloc.so.2"):
        assert os.environ[allocator.CONF] == allocator.KEEP_FREED_PAGES
    assert allocator.CONF not in os.environ and allocator.PRELOAD not in os.environ


def test_the_preload_is_restored_after_a_start_and_a_users_malloc_conf_kept(monkeypatch):
    monkeypatch.setenv(allocator.PRELOAD, "libuser.so")
    monkeypatch.setenv(allocator.CONF, "narenas:1")
    with allocator.preloaded("libjemalloc.so.2"):
        assert os.environ[allocator.PRELOAD] == "libjemalloc.so.2"
        assert os.environ[allocator.CONF] == "narenas:1"
    assert os.environ[allocator.PRELOAD] == "libuser.so"
    assert os.environ[allocator.CONF] == "narenas:1"
