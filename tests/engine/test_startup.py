"""A frontend reads the model's files while its engine core starts, and files that fail to read leave no
engine process behind."""

from __future__ import annotations

import gc
import shutil
import threading

import pytest

from nanoserve.engine import startup
from nanoserve.entrypoints.llm import LLM


class StartedClient:
    def __init__(self) -> None:
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


def test_the_model_files_are_read_while_the_engine_starts(monkeypatch):
    reading = threading.Event()

    def read(model_path: str) -> startup.FrontendFiles:
        reading.set()
        return startup.FrontendFiles("tokenizer", {"temperature": 0.5}, (2,))

    def make_client():
        # one after the other, this would wait in vain: the files are read only after the engine started
        assert reading.wait(10), "the model's files were not read while the engine core started"
        return client

    client = StartedClient()
    monkeypatch.setattr(startup, "read_frontend_files", read)
    engine_core, files = startup.start_engine("model", make_client)
    assert engine_core is client and not client.shut_down
    assert files == ("tokenizer", {"temperature": 0.5}, (2,))


def test_files_that_fail_to_read_shut_the_started_engine_down(monkeypatch):
    def read(model_path: str) -> startup.FrontendFiles:
        raise FileNotFoundError("no tokenizer")

    client = StartedClient()
    monkeypatch.setattr(startup, "read_frontend_files", read)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        startup.start_engine("model", lambda: client)
    assert client.shut_down


@pytest.mark.timeout(120)
def test_a_model_without_a_tokenizer_leaves_no_engine_process(tiny_gqa_dir, tmp_path):
    """The engine core loads (it reads no tokenizer), the frontend's files do not: the error is raised and
    the engine is stopped (tests/engine/conftest.py fails a test that leaves a process behind)."""
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_gqa_dir / name, folder / name)
    with pytest.raises(FileNotFoundError, match="No tokenizer files"):
        LLM(model=str(folder), dtype="float32")


def test_the_engine_starts_with_the_cyclic_collector_paused(monkeypatch):
    """Start-up makes hundreds of thousands of lasting objects; full collections among them are skipped."""
    seen = []

    def make_client():
        seen.append(gc.isenabled())
        return StartedClient()

    monkeypatch.setattr(startup, "read_frontend_files", lambda path: startup.FrontendFiles("t", {}, ()))
    startup.start_engine("model", make_client)
    assert seen == [False]
    assert gc.isenabled()
