"""`nanoserve bench families`: the load table, each family against the same-shape llama, and the MoE table."""

from __future__ import annotations

from nanoserve.bench.families import main


def test_families_table_has_a_row_per_family_and_batch_with_its_path_and_ratio(capsys):
    main(["--families", "gemma3,mixtral", "--batch-sizes", "1,2", "--repeats", "1", "--new-tokens", "2"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["gemma3"], ["mixtral"])]
    loads = [row for row in rows if len(row) == 3]
    assert [row[0] for row in loads] == ["gemma3", "mixtral"]
    against = [row for row in rows if len(row) > 3 and row[1] in ("yes", "no")]
    assert [(row[0], row[1], row[2]) for row in against] == [
        ("gemma3", "yes", "1"),
        ("gemma3", "yes", "2"),
        ("mixtral", "yes", "1"),
        ("mixtral", "yes", "2"),
    ]
    assert all(row[-2].endswith("x") for row in against), "family/llama: a ratio per row"
    assert "mixtral (8 experts, top-2) against llama with the same active parameters" in out
