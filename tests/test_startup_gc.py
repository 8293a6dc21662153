"""The cyclic collector during start-up: paused for the block, collected once and frozen where asked, and
left alone where someone else paused it."""

from __future__ import annotations

import gc
import weakref

import pytest

from nanoserve.startup_gc import collector_paused


class Node:
    def __init__(self) -> None:
        self.peer: Node | None = None


def garbage_cycle() -> weakref.ref:
    """A reference cycle no one holds: only the cyclic collector frees it."""
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def collector_restored():
    yield
    gc.unfreeze()
    gc.enable()


def test_the_collector_is_paused_for_the_block_and_takes_its_garbage_afterwards():
    with collector_paused():
        assert not gc.isenabled()
        cycle = garbage_cycle()
        kept = [Node() for _ in range(10_000)]  # enough new objects for several automatic collections
        assert cycle() is not None and kept
    assert gc.isenabled()
    for _ in range(100):  # the collector's own schedule: a young collection every few hundred objects
        kept = [Node() for _ in range(1000)]
        if cycle() is None:
            break
    assert cycle() is None


def test_freeze_collects_once_and_keeps_the_survivors_out_of_later_collections():
    before = gc.get_freeze_count()
    with collector_paused(freeze=True):
        cycle = garbage_cycle()
        kept = [Node() for _ in range(100)]
    assert cycle() is None
    assert gc.get_freeze_count() >= before + len(kept)
    assert gc.isenabled()


def test_a_collector_paused_by_someone_else_is_left_to_them():
    gc.disable()
    frozen = gc.get_freeze_count()
    with collector_paused(freeze=True):
        cycle = garbage_cycle()
    assert not gc.isenabled()
    assert cycle() is not None, "no collection ran: the outer pause collects when it ends"
    assert gc.get_freeze_count() == frozen
