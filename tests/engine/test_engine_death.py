"""Every way an engine core can die, seen from the client: nothing hangs, the cause is carried,
and no process is left behind."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.async_mp import AsyncMPClient
from nanoserve.engine.core_client.sync_mp import SyncMPClient
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.messages import EngineCoreRequest

NULL = EngineOptions(runner="null")

FAULT_SITECUSTOMIZE = textwrap.dedent(
    """
    import os

    _after = os.environ.get("NANOSERVE_TEST_FAIL_STEP_AFTER")
    if _after is not None:
        import nanoserve.core.engine_core as _ec

        _orig_step = _ec.EngineCore.step
        _count = [0]

        def _faulty_step(self):
            _count[0] += 1
            if _count[0] > int(_after):
                raise RuntimeError("injected step fault")
            return _orig_step(self)

        _ec.EngineCore.step = _faulty_step
    """
)


LONG_TOKENS = 16_000
"""A generation that outlasts every test that kills its engine mid-way, even on a fast CPU: on an AMD Zen
5 the tiny model took under a second for a few hundred tokens."""


def long_request(request_id: str = "long") -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=LONG_TOKENS, ignore_eos=True)
    )


def tiny_options(model_dir: Path) -> EngineOptions:
    """A real model with room for LONG_TOKENS positions, so that generation takes seconds."""
    num_kv_blocks = -(-(LONG_TOKENS + 3) // 16)
    return EngineOptions(model=str(model_dir), dtype="float32", num_kv_blocks=num_kv_blocks, num_threads=1)


DEATH_NOTICE_S = 10.0
"""Within how long a death must reach every waiter: well under a second on an idle machine, the margin
is for a loaded one (the suite runs on 2 shared cores)."""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.02)
    return gone(pid)


def in_thread(fn) -> tuple[threading.Thread, list]:
    result: list = []

    def run():
        try:
            result.append(fn())
        except BaseException as e:
            result.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.timeout(180)
def test_sigkill_sync_client_mid_generation(tiny_long_context_dir):
    client = SyncMPClient(tiny_options(tiny_long_context_dir))
    try:
        pid = client.engine_pids()[0]
        client.add_request(long_request())
        client.get_output(timeout=30)
        # a utility that stays pending while the request runs, and a getter blocked on the queue
        util_thread, util_result = in_thread(lambda: client.sleep(1, "wait"))
        time.sleep(0.2)
        getter_thread, getter_result = in_thread(lambda: [client.get_output() for _ in range(100_000)])
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        getter_thread.join(DEATH_NOTICE_S)
        util_thread.join(DEATH_NOTICE_S)
        assert time.monotonic() - killed_at < DEATH_NOTICE_S
        assert isinstance(getter_result[0], EngineDeadError), getter_result
        assert isinstance(util_result[0], EngineDeadError), util_result
        err = getter_result[0]
        assert err.engine_rank == 0 and err.exit_code == -signal.SIGKILL and err.signal == "SIGKILL"
        assert "SIGKILL" in str(err)
        # every later call fails at once
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            client.add_request(long_request("again"))
        with pytest.raises(EngineDeadError):
            client.get_output()
        with pytest.raises(EngineDeadError):
            client.call_utility("echo", 1)
        client.abort_requests(["long"])  # aborts after death are dropped quietly
        assert time.monotonic() - start < DEATH_NOTICE_S / 2  # at once: nothing waits on the dead engine
        assert wait_gone(pid, DEATH_NOTICE_S)
    finally:
        client.shutdown()


@pytest.mark.timeout(180)
def test_sigkill_async_client_mid_generation(tiny_long_context_dir):
    async def main():
        client = AsyncMPClient(tiny_options(tiny_long_context_dir))
        try:
            pid = client.engine_pids()[0]
            await client.add_request_async(long_request())
            await client.get_output_async(timeout=30)
            util = asyncio.create_task(client.sleep_async(1, "wait"))

            async def consume():
                while True:
                    await client.get_output_async()

            getter = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            done, _ = await asyncio.wait({util, getter}, timeout=DEATH_NOTICE_S)
            assert time.monotonic() - killed_at < DEATH_NOTICE_S
            assert done == {util, getter}
            for task in (util, getter):
                assert isinstance(task.exception(), EngineDeadError)
            assert getter.exception().signal == "SIGKILL"
            with pytest.raises(EngineDeadError):
                await client.add_request_async(long_request("again"))
            with pytest.raises(EngineDeadError):
                await client.get_output_async()
            with pytest.raises(EngineDeadError):
                await client.call_utility_async("echo", 1)
            assert wait_gone(pid, DEATH_NOTICE_S)
        finally:
            client.shutdown()

    asyncio.run(main())


@pytest.fixture
def faulty_step(tmp_path, monkeypatch):
    """Make the engine child's EngineCore.step raise after a few steps, via sitecustomize."""
    (tmp_path / "sitecustomize.py").write_text(FAULT_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("NANOSERVE_TEST_FAIL_STEP_AFTER", "3")


@pytest.mark.timeout(120)
def test_engine_raising_in_step_sync(faulty_step):
    client = SyncMPClient(NULL)
    try:
        pid = client.engine_pids()[0]
        client.add_request(long_request())
        with pytest.raises(EngineDeadError) as info:
            for _ in range(1000):
                client.get_output(timeout=10)
        err = info.value
        assert err.engine_rank == 0
        assert err.exc_type == "RuntimeError" and err.exc_message == "injected step fault"
        assert "_faulty_step" in err.traceback_tail
        assert "injected step fault" in str(err) and "\n" not in str(err)
        assert any("injected step fault" in note for note in err.__notes__)
        assert wait_gone(pid, DEATH_NOTICE_S)
        deadline = time.monotonic() + DEATH_NOTICE_S
        while err.exit_code is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert err.exit_code == 1  # the monitor adds the exit code once the process is reaped
        with pytest.raises(EngineDeadError):
            client.call_utility("echo", 1)
    finally:
        client.shutdown()


@pytest.mark.timeout(120)
def test_engine_raising_in_step_async(faulty_step):
    async def main():
        client = AsyncMPClient(NULL)
        try:
            await client.add_request_async(long_request())
            with pytest.raises(EngineDeadError) as info:
                for _ in range(1000):
                    await client.get_output_async(timeout=10)
            assert info.value.exc_type == "RuntimeError"
            assert info.value.exc_message == "injected step fault"
        finally:
            client.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("client_cls", [SyncMPClient, AsyncMPClient])
def test_client_dropped_without_shutdown_reclaims_engine(client_cls):
    client = client_cls(NULL)
    pid = client.engine_pids()[0]
    del client
    gc.collect()
    assert wait_gone(pid, DEATH_NOTICE_S)


FRONTEND_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from nanoserve.config import EngineOptions
    from nanoserve.engine.core_client.sync_mp import SyncMPClient

    client = SyncMPClient(EngineOptions(runner="null"))
    print(client.engine_pids()[0], flush=True)
    time.sleep(600)
    """
)


@pytest.mark.timeout(120)
def test_engine_dies_with_sigkilled_frontend(tmp_path):
    script = tmp_path / "frontend.py"
    script.write_text(FRONTEND_SCRIPT)
    frontend = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        engine_pid = int(frontend.stdout.readline())
        assert not gone(engine_pid)
        frontend.kill()
        frontend.wait(5)
        assert wait_gone(engine_pid, DEATH_NOTICE_S), "the engine outlived its frontend"
    finally:
        if frontend.poll() is None:
            frontend.kill()
            frontend.wait()
        frontend.stdout.close()


@pytest.fixture
def hanging_init(tmp_path, monkeypatch):
    """Make the engine child's EngineCore construction hang (a stuck weight load)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\n"
        "if os.environ.get('NANOSERVE_TEST_HANG_INIT'):\n"
        "    import nanoserve.core.engine_core as ec\n"
        "    ec.EngineCore.__init__ = lambda self, *a, **k: time.sleep(600)\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("NANOSERVE_TEST_HANG_INIT", "1")


@pytest.mark.timeout(180)
def test_ready_timeout_during_hung_load_stops_the_child(hanging_init, monkeypatch, caplog):
    # long enough for a spawn to reach its build (and hang there) even on a loaded machine
    monkeypatch.setenv("NANOSERVE_ENGINE_READY_TIMEOUT_S", "30")
    with pytest.raises(TimeoutError, match="NANOSERVE_ENGINE_READY_TIMEOUT_S") as info:
        SyncMPClient(NULL)
    assert "engine 0: started" in str(info.value)  # the last phase it reached
    # the child takes SIGTERM during its (hung) build and exits at once: no SIGKILL was needed
    assert not [r for r in caplog.records if "did not stop" in r.getMessage()]


@pytest.mark.timeout(180)
def test_engine_killed_during_startup_raises_at_once(hanging_init):
    # construction hangs; kill the child while the client waits for it
    killed_at: list[float] = []

    def killer():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for child in psutil.Process().children():
                if "EngineCore_0" in " ".join(child.cmdline()):
                    time.sleep(1.0)
                    killed_at.append(time.monotonic())
                    child.kill()
                    return
            time.sleep(0.05)

    threading.Thread(target=killer, daemon=True).start()
    with pytest.raises(EngineDeadError) as info:
        SyncMPClient(NULL)
    assert killed_at and time.monotonic() - killed_at[0] < DEATH_NOTICE_S
    assert info.value.signal == "SIGKILL"
    assert "start-up" in str(info.value)


@pytest.mark.timeout(120)
def test_corrupt_output_stream_is_a_death_not_a_hang():
    import zmq

    client = SyncMPClient(NULL)
    try:
        getter, result = in_thread(lambda: client.get_output())
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(client.addresses.output)
        push.send(b"\xc1 not msgpack")
        getter.join(2)
        push.close(linger=0)
        ctx.term()
        assert isinstance(result[0], EngineDeadError)
        assert "output socket failed" in str(result[0])
        with pytest.raises(EngineDeadError):
            client.call_utility("echo", 1)
    finally:
        client.shutdown()
