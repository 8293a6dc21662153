"""The `nanoserve` CLI: flag mapping in process, `generate` in a real subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.config import EngineOptions
from nanoserve.entrypoints.cli import build_parser, engine_options_from_args

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanoserve.entrypoints.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_engine_flags_map_to_options():
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--model",
            "m",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "512",
            "--block-size",
            "8",
            "--num-kv-blocks",
            "64",
            "--kv-cache-memory-bytes",
            "1000000",
            "--no-prefix-caching",
            "--seed",
            "3",
            "--no-multiprocess",
        ]
    )
    assert engine_options_from_args(args) == EngineOptions(
        model="m",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        block_size=8,
        num_kv_blocks=64,
        kv_cache_memory_bytes=1000000,
        enable_prefix_caching=False,
        seed=3,
        multiprocess_mode=False,
    )


def test_absent_flags_keep_option_defaults():
    args = build_parser().parse_args(["generate", "hi"])
    assert engine_options_from_args(args) == EngineOptions()
    assert (args.max_tokens, args.temperature, args.chat) == (64, 0.7, False)
    assert build_parser().parse_args(["generate", "hi", "--multiprocess"]).multiprocess_mode is True


def test_generate_streams_text(tiny_gqa_dir):
    common = ["--model", str(tiny_gqa_dir), "--dtype", "float32", "--max-tokens", "8", "--temperature", "0"]
    result = run_cli("generate", "Hello, my name is", *common)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.endswith("\n") and result.stdout.strip()

    from nanoserve.entrypoints.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    with LLM(model=str(tiny_gqa_dir), dtype="float32") as llm:
        (expected,) = llm.generate(
            "Hello, my name is", SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
        )
    assert result.stdout == expected.outputs[0].text + "\n"

    chat = run_cli("generate", "Hi!", "--chat", *common)
    assert chat.returncode == 0, chat.stderr[-2000:]


def test_generate_bad_input_exits_with_message(tiny_gqa_dir):
    result = run_cli("generate", "x " * 100, "--model", str(tiny_gqa_dir), "--max-model-len", "32")
    assert result.returncode == 2
    assert "longer than the maximum model length" in result.stderr


@pytest.mark.parametrize("args", [[], ["generate"], ["nope"]])
def test_usage_errors(args):
    result = run_cli(*args, timeout=60)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_web_server_flags_map_to_options():
    from nanoserve.entrypoints.openai.api_server import server_options_from_args

    parse = build_parser().parse_args
    options = server_options_from_args(parse(["serve", "--no-web", "--root-path", "/nanoserve"]))
    assert options.web is False and options.root_path == "/nanoserve"
    options = server_options_from_args(parse(["serve"]))
    assert options.web is True and options.root_path == ""
    for bad in ("nanoserve", "/nanoserve/"):
        with pytest.raises(ValueError, match="root_path"):
            server_options_from_args(parse(["serve", "--root-path", bad]))
