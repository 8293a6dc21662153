"""`nanoserve bench prefix` at toy sizes: a row per count of cached turns, each lookup finding the system
prompt's blocks and the template's tokens cached."""

from __future__ import annotations

from nanoserve.bench import prefix


def test_prefix_bench_prints_a_row_per_count_with_the_shared_tokens_found(capsys):
    prefix.main(["--cached-turns", "3", "30", "--lookups", "5", "--block-size", "8", "--system-blocks", "2"])
    lines = capsys.readouterr().out.splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[0] for row in rows] == ["3", "30"]
    for _, micros, found in rows:
        assert float(micros) > 0
        # 2 whole blocks of system prompt, then the template's 3 tokens from a cached turn's block (a
        # random token more matches one time in 49152)
        assert 2 * 8 + len(prefix.TEMPLATE) <= float(found) < 2 * 8 + len(prefix.TEMPLATE) + 1
