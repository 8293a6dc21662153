"""`nanoserve bench throughput` at toy sizes: greedy and sampled columns per engine, and their ratios."""

from __future__ import annotations

import re

import pytest

from nanoserve.bench import throughput


@pytest.mark.timeout(300)
def test_throughput_table_has_a_sampled_column_and_ratio_per_engine(capsys):
    throughput.main(["--engines", "inproc", "--batch-sizes", "2", "--new-tokens", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "greedy and sampled (temperature 0.8, top_p 0.95)" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("batch"))
    assert "nanoserve (inproc) sampled" in header and "inproc sampled/greedy" in header
    row = next(line for line in out.splitlines() if line.lstrip().startswith("2 "))
    assert re.fullmatch(r"\s*2(\s+[\d.]+ \(\d+-\d+\)){2}\s+\d+\.\d\dx", row), row
