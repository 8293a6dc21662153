"""Server fixtures shared by the server tests (the servers themselves are in openai_server.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from servers import Server


@pytest.fixture
def own_server(tiny_gqa_dir, tmp_path):
    """A factory for servers a test may break; all are killed at the end of the test."""
    servers: list[Server] = []

    def start(*extra: str) -> Server:
        servers.append(Server(tiny_gqa_dir, tmp_path / f"server{len(servers)}.log", *extra))
        return servers[-1]

    yield start
    for srv in servers:
        srv.stop()


@pytest.fixture(scope="module")
def model_name(tiny_gqa_dir) -> str:
    return Path(tiny_gqa_dir).name
