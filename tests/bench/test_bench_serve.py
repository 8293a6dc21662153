"""`nanoserve bench serve` against a real `nanoserve serve` on a tiny model: rows, token counts, plot."""

from __future__ import annotations

import pytest

from nanoserve.bench import serve


@pytest.mark.timeout(240)
def test_bench_serve_measures_every_level_and_draws_them(tiny_gqa_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    tiny = ["--model", str(tiny_gqa_dir), "--dtype", "float32", "--max-model-len", "512"]
    plot = tmp_path / "serve.png"
    with serve.local_server("tiny", tiny) as url:
        argv = ["--url", url, "--concurrency", "1", "4", "--num-prompts", "8", "--max-tokens", "6"]
        assert serve.main([*argv, "--prompt-words", "8", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["4"])]
    assert [r[0] for r in rows] == ["1", "4"]
    for row in rows:
        assert row[1] == "8/8", row
        # 8 requests x 6 tokens each (ignore_eos), over the level's duration
        req_s, tok_s = float(row[2]), float(row[3])
        assert tok_s == pytest.approx(req_s * 6, rel=0.01)
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
