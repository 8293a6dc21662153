"""`nanoserve bench peers` on the bundled model, with a peer that is not installed here (llama.cpp lives
in .venv-peers only): nanoserve's rows (greedy, sampled) are measured, the peer's row names its error, and the plot is drawn."""

from __future__ import annotations

import pytest

from nanoserve.bench import peers


@pytest.mark.timeout(600)
def test_peers_table_and_plot_with_a_missing_peer(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "peers.png"
    argv = ["--systems", "nanoserve,llamacpp", "--batch-sizes", "1,2", "--new-tokens", "4", "--repeats", "1"]
    argv += ["--ttft-prompt-len", "16", "--work-dir", str(tmp_path), "--plot", str(plot)]
    peers.main(argv)
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line for line in out.splitlines() if line.startswith(("nanoserve", "llama"))}
    assert rows["nanoserve"].count("(") == 3, out  # batch 1, batch 2 and TTFT measured
    assert rows["nanoserve sampled"].count("(") == 2, out  # batch 1 and 2, sampled
    assert "error: " in out and "llama_cpp" in out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
