"""The cyclic collector during start-up: paused for the block, collected once and frozen where asked, and
left alone where someone else paused it."""

from __future__ import annotations

import gc
import os
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
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


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


def test_a_block_that_raises_turns_the_collector_on_again_and_freezes_nothing():
    frozen = gc.get_freeze_count()
    with pytest.raises(SystemExit), collector_paused(freeze=True):
        raise SystemExit(0)
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen


@pytest.mark.timeout(30)
def test_a_process_forked_inside_the_block_starts_with_the_collector_on():
    with collector_paused():
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child reports its collector's state and leaves at once
            os.write(write, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.close(write)
        child_state = os.read(read, 1)
        os.close(read)
        os.waitpid(pid, 0)
        assert not gc.isenabled()
    assert child_state == b"1"
