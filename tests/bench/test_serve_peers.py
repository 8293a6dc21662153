"""`nanoserve bench serve --compare-peers` without running vLLM (too slow for the suite): reading vLLM's
result JSON, the table with its ratios and targets, the flags it refuses, and the server process helper's
clean-up."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from nanoserve.bench import serve
from nanoserve.bench.serve_peers import (
    ClientLevel,
    ServerRun,
    client_command,
    format_table,
    parse_result,
    target_checks,
)


def vllm_result(tok_s: float, ttft: float, tpot: float, failed: int = 0) -> dict:
    """The fields `vllm bench serve --save-result --metric-percentiles 50,99` writes, a few others beside."""
    return {
        "backend": "openai",
        "completed": 8 - failed,
        "failed": failed,
        "output_throughput": tok_s,
        "request_throughput": tok_s / 128,
        **{f"mean_{m}_ms": v * 1.1 for m, v in (("ttft", ttft), ("tpot", tpot), ("itl", tpot))},
        **{f"median_{m}_ms": v for m, v in (("ttft", ttft), ("tpot", tpot), ("itl", tpot))},
        **{f"p50_{m}_ms": v for m, v in (("ttft", ttft), ("tpot", tpot), ("itl", tpot))},
        **{f"p99_{m}_ms": v * 2 for m, v in (("ttft", ttft), ("tpot", tpot), ("itl", tpot))},
    }


def run(ready_s: float, c1: tuple[float, float, float], c32: tuple[float, float, float]) -> ServerRun:
    return ServerRun(ready_s, {1: parse_result(vllm_result(*c1)), 32: parse_result(vllm_result(*c32))})


def test_parse_result_takes_medians_and_p99_from_vllms_json():
    level = parse_result(vllm_result(30.0, 60.0, 32.0, failed=2))
    assert level == ClientLevel(6, 8, 30.0, 60.0, 120.0, 32.0, 64.0, 32.0, 64.0)


def test_table_has_every_server_the_ratios_to_vllm_and_the_targets():
    runs = {
        "vllm": run(125.0, (29.5, 61.0, 32.0), (429.0, 711.0, 71.0)),
        "nanoserve": run(25.0, (23.6, 64.05, 42.0), (600.6, 426.0, 123.0)),
        "nanoserve-int4": ServerRun(error="RuntimeError: nanoserve-int4 not healthy"),
    }
    lines = format_table(runs).splitlines()
    rows = {line[:40].strip(): line[40:].split() for line in lines}
    assert rows["vLLM-CPU OpenAI server"] == ["125.0", "29.5", "61.0", "32.0", "429.0", "711.0", "71.0"]
    assert rows["nanoserve serve / vLLM"] == [
        "0.20x",
        "0.80x",
        "1.05x",
        "1.31x",
        "1.40x",
        "0.60x",
        "1.73x",
    ]
    assert rows["nanoserve serve --quantization int4"] == ["-"] * 7
    assert "  error: RuntimeError: nanoserve-int4 not healthy" in lines
    targets = next(line for line in lines if line.startswith("  nanoserve serve:"))
    assert targets.split(": ", 1)[1] == (
        "c=32 out tok/s >= 1.3x: 1.40x met, c=1 TTFT p50 <= 1.0x: 1.05x not met, c=1 TPOT p50 <= 1.0x: 1.31x not met"
    )


def test_targets_are_unknown_where_a_side_has_no_level_and_failures_are_listed():
    peer = ServerRun(125.0, {1: parse_result(vllm_result(29.5, 61.0, 32.0, failed=3))})
    ours = run(20.0, (70.0, 50.0, 13.0), (270.0, 998.0, 113.0))
    assert target_checks(ours, peer) == [
        ("c=32 out tok/s >= 1.3x", None, None),
        ("c=1 TTFT p50 <= 1.0x", 50.0 / 61.0, True),
        ("c=1 TPOT p50 <= 1.0x", 13.0 / 32.0, True),
    ]
    assert "  c=1: 3 of 8 failed" in format_table({"vllm": peer, "nanoserve": ours}).splitlines()


def test_client_command_is_the_targets_load_and_saves_its_json_where_it_is_read(tmp_path):
    args = serve.build_parser().parse_args(["--compare-peers"])
    result = tmp_path / "vllm-c32.json"
    cmd = client_command(args, "http://127.0.0.1:8001", "m", tmp_path / "hf", (32, 64), result)
    assert cmd[1:5] == ["-m", "nanoserve.bench.vllm_cli", "bench", "serve"]
    options = dict(zip(cmd[7:-1:2], cmd[8:-1:2], strict=True))
    assert {k: options[k] for k in ("--random-input-len", "--random-output-len", "--max-concurrency")} == {
        "--random-input-len": "32",
        "--random-output-len": "128",
        "--max-concurrency": "32",
    }
    assert (options["--num-prompts"], options["--temperature"], options["--num-warmups"]) == (
        "64",
        "0.0",
        "32",
    )
    assert (options["--result-dir"], options["--result-filename"]) == (str(tmp_path), "vllm-c32.json")
    assert {"--save-result", "--ignore-eos"} <= set(cmd)


def test_input_len_sets_the_clients_prompt_length(tmp_path):
    args = serve.build_parser().parse_args(["--compare-peers", "--input-len", "1024"])
    cmd = client_command(args, "http://127.0.0.1:8001", "m", tmp_path / "hf", (1, 8), tmp_path / "r.json")
    assert cmd[cmd.index("--random-input-len") + 1] == "1024"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--compare-peers", "--url", "http://127.0.0.1:9"], "--url does not apply to --compare-peers"),
        (["--compare-peers", "--concurrency", "4"], "--concurrency does not apply to --compare-peers"),
        (["--compare-peers", "--systems", "vllm,tgi"], "unknown server(s): tgi"),
        (["--systems", "vllm"], "--systems needs --compare-peers"),
        (["--input-len", "1024"], "--input-len needs --compare-peers"),
        (["--compare-peers", "--input-len", "0"], "--input-len must be at least 1, got 0"),
    ],
)
def test_flags_that_do_not_apply_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_without_vllm_it_says_where_to_run_it(capsys):
    with pytest.raises(SystemExit):
        serve.main(["--compare-peers"])
    assert ".venv-peers" in capsys.readouterr().err


# A server answering /health that leaves a child behind in its process group, as an engine would.
LEAKY_SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[2], "w").write(str(child.pid))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def is_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"  # a zombie not yet reaped
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.timeout(60)
def test_server_process_times_readiness_and_leaves_no_process_behind(tmp_path):
    port, pid_file = serve.free_port(), tmp_path / "child.pid"
    cmd = [sys.executable, "-c", LEAKY_SERVER, str(port), str(pid_file)]
    with serve.server_process("leaky", cmd, port) as server:
        assert server.url == f"http://127.0.0.1:{port}" and server.ready_s > 0
        child = int(pid_file.read_text())
        assert not is_gone(child)
    deadline = time.monotonic() + 10
    while not is_gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert is_gone(child)


@pytest.mark.timeout(60)
def test_server_process_that_exits_is_reported_with_its_log():
    cmd = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exit code 3.*no model here"):
        with serve.server_process("broken", cmd, serve.free_port()):
            pass


def test_the_plot_draws_vllm_client_levels(tmp_path):
    pytest.importorskip("matplotlib")
    from nanoserve.bench.plot import plot_serve

    plot = tmp_path / "serve-peers.png"
    runs = {
        "vLLM": run(125.0, (29.5, 61.0, 32.0), (429.0, 711.0, 71.0)),
        "nanoserve": run(25.0, (23.6, 64.0, 42.0), (255.0, 426.0, 123.0)),
    }
    plot_serve(str(plot), {name: r.levels for name, r in runs.items()})
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
