"""`nanoserve bench peers` on the bundled model, with a peer that is not installed here (llama.cpp lives
in .venv-peers only): nanoserve's rows (greedy, sampled) are measured, the peer's row names its error, and the plot is drawn."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nanoserve.bench import peers


@pytest.mark.timeout(600)
def test_peers_table_and_plot_with_a_missing_peer(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "peers.png"
    argv = ["--systems", "nanoserve,llamacpp", "--batch-sizes", "1,2", "--new-tokens", "4", "--repeats", "1"]
    argv += ["--ttft-prompt-len", "16", "--cached-prefix-len", "32", "--cached-prefix-new-tokens", "16"]
    argv += ["--work-dir", str(tmp_path), "--plot", str(plot)]
    peers.main(argv)
    out = capsys.readouterr().out
    speed, start_up = out.split("\nstart-up: ")

    def rows(table: str) -> dict[str, str]:
        return {
            line.split("  ")[0]: line
            for line in table.splitlines()
            if line.startswith(("nanoserve", "llama"))
        }

    assert rows(speed)["nanoserve"].count("(") == 4, out  # batch 1, batch 2 and both TTFTs measured
    assert "TTFT-16 ms" in out and "TTFT 32+16 ms" in out, out
    assert rows(speed)["nanoserve sampled"].count("(") == 2, out  # batch 1 and 2, sampled
    assert "error: " in out and "llama_cpp" in out
    load_s, _, memory_mib, _, kv_cache_mib, _ = rows(start_up)["nanoserve"].split()[1:]
    # the engine holds its weights (about 100 MB in the file) and more; its KV cache is the default, 1 GiB
    # in whole blocks
    assert 0 < float(load_s) < 600 and 100 < float(memory_mib) < 20_000, out
    assert 1000 < float(kv_cache_mib) <= 1024, out
    assert rows(start_up)[peers.system_label("llamacpp")].split()[-3:] == ["-"] * 3, out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rounds_take_the_systems_in_turn_and_pool_their_runs(tmp_path, monkeypatch, capsys):
    """--rounds 2: nanoserve, llama.cpp, nanoserve, llama.cpp; each row's median is over both rounds, and the
    read bandwidth measured before each run is printed beside it and summed up per system."""
    calls = []
    bandwidths = iter([30e9, 20e9, 40e9, 25e9])
    monkeypatch.setattr(peers, "read_bandwidth", lambda: next(bandwidths))
    speeds = {"nanoserve": iter([[100.0, 110.0], [60.0, 70.0]]), "llamacpp": iter([[50.0], [40.0]])}

    def fake_run_system(system, spec_file, log_dir, timeout):
        calls.append(system)
        runs = next(speeds[system])
        start_up = {
            "load_s": [runs[0] / 10],
            "memory_bytes": [int(runs[-1]) << 20],
            "kv_cache_bytes": [10 << 20],
        }
        return {
            "tok_s": {"1": runs},
            "sampled_tok_s": {"1": runs},
            "ttft_s": [0.5],
            "error": None,
            **start_up,
        }

    monkeypatch.setattr(peers, "run_system", fake_run_system)
    argv = ["--systems", "nanoserve,llamacpp", "--batch-sizes", "1", "--repeats", "2", "--rounds", "2"]
    peers.main([*argv, "--work-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert calls == ["nanoserve", "llamacpp", "nanoserve", "llamacpp"]
    speed, start_up = out.split("\nstart-up: ")
    rows = {
        line.split("  ")[0]: line.split()
        for line in speed.splitlines()
        if line.startswith(("nanoserve", "llama"))
    }
    assert rows["nanoserve"][1:3] == ["85.0", "(60-110)"], out  # median of 100, 110, 60, 70
    assert rows[f"nanoserve/{peers.system_label('llamacpp')}"][-3:] == ["1.89x", "1.00x", "-"], out  # 85 / 45
    assert "round 2, nanoserve: " in out and "(read bandwidth before it: 40.0 GB/s)" in out, out
    llamacpp = peers.system_label("llamacpp")
    assert f"GB/s: nanoserve 35.0 (30.0-40.0); {llamacpp} 22.5 (20.0-25.0)" in out, out
    # start-up pooled over the rounds: load 10 and 6 s, 110 and 70 MiB against 5 and 4 s, 50 and 40 MiB,
    # each with a KV cache of 10 MiB
    start_up_rows = {line.split("  ")[0]: line.split() for line in start_up.splitlines()}
    assert start_up_rows["nanoserve"][1:] == ["8.0", "(6-10)", "90.0", "(70-110)", "10.0", "(10-10)"], out
    assert start_up_rows[f"nanoserve/{llamacpp}"][-3:] == ["1.78x", "2.00x", "1.00x"], out  # 8 / 4.5, 90 / 45


def test_merge_results_keeps_the_first_error():
    first = {"tok_s": {"1": [1.0]}, "sampled_tok_s": {}, "ttft_s": [0.1], "error": "boom"}
    second = {
        "tok_s": {"1": [2.0], "8": [3.0]},
        "sampled_tok_s": {"1": [4.0]},
        "ttft_s": [],
        "error": "later",
    }
    merged = peers.merge_results(first, second)
    assert merged == {
        "tok_s": {"1": [1.0, 2.0], "8": [3.0]},
        "sampled_tok_s": {"1": [4.0]},
        "ttft_s": [0.1],
        "prefix_ttft_s": [],
        "load_s": [],
        "memory_bytes": [],
        "kv_cache_bytes": [],
        "error": "boom",
    }


def test_time_to_first_token_is_measured_before_the_throughput_runs(tmp_path, monkeypatch):
    """The throughput prompts are windows of one passage: once they are cached, a TTFT prompt that starts
    where one of them does would find its first blocks in the prefix cache."""
    calls = []

    def runner(spec):
        def throughput(prompts, new_tokens, sampled):
            calls.append("throughput")
            return 1.0

        def ttft(prompt):
            if len(prompt) > 1:
                calls.append("ttft:" + ",".join(map(str, prompt)))
                return 0.2
            calls.append("ttft")
            return 0.1

        return peers.Runner(throughput, ttft, None, 0)

    monkeypatch.setitem(peers.RUNNERS, "nanoserve", runner)
    spec = {"prompts": {"1": [[5, 6]]}, "new_tokens": 2, "repeats": 1, "ttft_prompts": [[7], [8], [9]]}
    spec["prefix_prompts"] = [[1, 2, 3], [1, 2, 4]]
    spec_file, result_file = tmp_path / "spec.json", tmp_path / "result.json"
    spec_file.write_text(json.dumps(spec))
    peers.worker("nanoserve", str(spec_file), str(result_file))
    # warm-ups first, then the cached-prefix prompts (the first caches the prefix), greedy and sampled
    assert calls == ["ttft"] * 3 + ["ttft:1,2,3", "ttft:1,2,4"] + ["throughput"] * 3
    result = json.loads(result_file.read_text())
    assert result["ttft_s"] == [0.1, 0.1] and result["prefix_ttft_s"] == [0.2]
    assert len(result["load_s"]) == 1 and isinstance(result["memory_bytes"][0], int)


def test_a_failed_ttft_leaves_the_throughput_runs_measured(tmp_path, monkeypatch):
    def runner(spec):
        def ttft(prompt):
            raise ValueError("prompt longer than the context")

        return peers.Runner(lambda prompts, new_tokens, sampled: 2.0, ttft, None, 0)

    monkeypatch.setitem(peers.RUNNERS, "nanoserve", runner)
    spec = {"prompts": {"1": [[5, 6]]}, "new_tokens": 2, "repeats": 1, "ttft_prompts": [[7], [8]]}
    spec["prefix_prompts"] = [[1, 2], [1, 3]]
    spec_file, result_file = tmp_path / "spec.json", tmp_path / "result.json"
    spec_file.write_text(json.dumps(spec))
    peers.worker("nanoserve", str(spec_file), str(result_file))
    result = json.loads(result_file.read_text())
    assert result["tok_s"] == {"1": [2.0]} and result["sampled_tok_s"] == {"1": [2.0]}
    assert result["ttft_s"] == [] and result["prefix_ttft_s"] == []
    assert result["error"].startswith("TTFT: ValueError: prompt longer")  # the first failure's


# a worker that starts a child of its own (as an engine does), writes the child's pid to argv[1] and runs
# until it is killed
LINGERING_WORKER = (
    "import subprocess, sys, time; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "open(sys.argv[1], 'w').write(f'{child.pid}'); time.sleep(600)"
)

STOPPED_RUN = """
import signal, sys
from pathlib import Path
from nanoserve.bench import cli, peers

# Ctrl-C raises KeyboardInterrupt, as in a terminal's foreground job, even when these tests were started
# in the background of a shell without job control, whose children inherit SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
work, pid_file, worker = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
peers.worker_command = lambda system, spec_file, result_file: [sys.executable, "-c", worker, pid_file]
cli.raise_on_sigterm()
peers.run_system("nanoserve", work / "spec.json", work, timeout=600)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_recorded(pid_file: Path) -> None:
    """The worker's child, if the worker got as far as recording it (a failed test must not leave it)."""
    if pid_file.exists() and pid_file.read_text():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stopped_run_takes_down_its_worker_and_the_workers_children(tmp_path, stop):
    """Workers run in sessions of their own, out of reach of the terminal's Ctrl-C: stopping `bench peers`
    must kill them, and the engines they started, instead of leaving them decoding beside the next run."""
    pid_file = tmp_path / "grandchild.pid"
    run = subprocess.Popen(
        [sys.executable, "-c", STOPPED_RUN, str(tmp_path), str(pid_file), LINGERING_WORKER]
    )
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert run.poll() is None and time.monotonic() < deadline, "the worker never started its child"
            time.sleep(0.1)
        grandchild = int(pid_file.read_text())
        workers = [p for p in psutil.Process(run.pid).children() if p.pid != grandchild]
        assert len(workers) == 1 and not _gone(grandchild)
        run.send_signal(stop)
        assert run.wait(timeout=30) != 0
        deadline = time.monotonic() + 30
        while not (_gone(grandchild) and _gone(workers[0].pid)):
            assert time.monotonic() < deadline, "the worker or its child outlived the stopped run"
            time.sleep(0.1)
    finally:
        run.kill()
        run.wait()
        _kill_recorded(pid_file)


@pytest.mark.timeout(120)
def test_a_worker_past_its_time_is_killed_with_its_children_and_named_in_the_error(tmp_path, monkeypatch):
    pid_file = tmp_path / "grandchild.pid"
    monkeypatch.setattr(
        peers, "worker_command", lambda *_: [sys.executable, "-c", LINGERING_WORKER, str(pid_file)]
    )
    try:
        result = peers.run_system("nanoserve", tmp_path / "spec.json", tmp_path, timeout=5)
        assert result["error"].startswith("timed out after 5 s (log: "), result
        deadline = time.monotonic() + 30
        while not _gone(int(pid_file.read_text())):
            assert time.monotonic() < deadline, "the worker's child outlived the timed-out run"
            time.sleep(0.1)
    finally:
        _kill_recorded(pid_file)


@pytest.mark.timeout(120)
def test_a_worker_that_fails_is_reported_with_its_exit_code_and_last_line(tmp_path, monkeypatch):
    worker = "import sys; print('loading'); print('no such model', file=sys.stderr); sys.exit(3)"
    monkeypatch.setattr(peers, "worker_command", lambda *_: [sys.executable, "-c", worker])
    result = peers.run_system("nanoserve", tmp_path / "spec.json", tmp_path, timeout=60)
    assert result["error"].startswith("exit 3: no such model (log: "), result
    assert result["tok_s"] == {} and result["ttft_s"] == []
