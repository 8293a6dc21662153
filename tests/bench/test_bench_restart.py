"""`nanoserve bench restart` at toy sizes on a tiny model: it kills and restarts the engine, and prints
a recovery row per in-flight count and the ledger-cost ratio."""

from __future__ import annotations

import pytest

from nanoserve.bench import restart


@pytest.mark.timeout(300)
def test_restart_bench_prints_recovery_rows_and_the_ledger_ratio(tiny_gqa_dir, capsys):
    argv = [
        "--model",
        str(tiny_gqa_dir),
        "--in-flight",
        "1",
        "3",
        "--repeats",
        "1",
        "--tokens-before-kill",
        "4",
    ]
    argv += [
        "--max-tokens",
        "400",
        "--batch",
        "2",
        "--batch-tokens",
        "8",
        "--kv-cache-memory-bytes",
        str(1 << 24),
    ]
    restart.main(argv)
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0] in ("1", "3")]
    assert [row[0] for row in rows] == ["1", "3"]
    for row in rows:
        first, every, ready = (float(cell.rstrip("s")) for cell in row[1:4])
        assert 0 < ready <= first <= every
    assert any(line.strip().startswith("ratio with/without:") for line in lines)
