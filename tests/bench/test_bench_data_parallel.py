"""The data-parallel modes of `nanoserve bench ipc` and `nanoserve bench serve`, at toy sizes."""

from __future__ import annotations

import pytest

from nanoserve.bench import ipc, serve


@pytest.mark.timeout(30)
def test_ipc_data_parallel_prints_a_row_per_engine_count(capsys):
    argv = ["--data-parallel-size", "2", "--num-requests", "4", "--max-tokens", "4", "--repeats", "1"]
    assert ipc.main(argv) == 0
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[:2] == ["2", "DPLBSyncMPClient"] and row[4] == "DPLBAsyncMPClient"


def test_compare_report_ratio_is_against_the_first_size():
    def stats(tok_s: float) -> serve.LevelStats:
        return serve.LevelStats(8, 8, 1.0, tok_s, 10.0, 20.0, 5.0, 6.0)

    table = serve.compare_report({1: {8: stats(100.0)}, 2: {8: stats(150.0)}})
    header, row = table.splitlines()
    assert "DP2/DP1" in header
    assert row.split()[0] == "8" and row.endswith("1.50x")
