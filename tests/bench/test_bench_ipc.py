"""`nanoserve bench ipc` over TCP, with CURVE as served and without, at toy sizes."""

from __future__ import annotations

import re

import pytest

from nanoserve.bench import ipc


@pytest.mark.timeout(300)
@pytest.mark.parametrize("curve", ["--zmq-curve", "--no-zmq-curve"])
def test_ipc_over_tcp_reports_curve_and_the_round_trip(capsys, curve):
    argv = ["--transport", "tcp", curve, "--num-requests", "4", "--max-tokens", "8"]
    assert ipc.main([*argv, "--raw-messages", "2000", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert f"over tcp, curve {'off' if curve.startswith('--no') else 'on'};" in out
    assert re.search(r"SyncMPClient utility round trip \(median of 2000\): \d+ us", out)
