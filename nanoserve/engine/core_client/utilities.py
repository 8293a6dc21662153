"""UtilityCalls: the utility calls a client is waiting on, by call id.

A call's future is a `concurrent.futures.Future` (sync client) or an `asyncio.Future` (asyncio client,
completed only on its own loop: the reader resolves it there, and deaths are delivered there). Each
entry remembers the rank and incarnation it was sent to, so the death of that incarnation fails it
(utility calls are not replayed after a restart: they may not be idempotent) while calls held for the
next incarnation wait on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading

from nanoserve.wire.messages import UtilityOutput

logger = logging.getLogger(__name__)

Future = concurrent.futures.Future | asyncio.Future


def fail_future(future: Future, error: BaseException) -> None:
    """Fail a future unless its caller already gave up on it (cancelled) or it is done."""
    with contextlib.suppress(asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
        if not future.done():
            future.set_exception(error)


class UtilityCalls:
    def __init__(self) -> None:
        self._calls: dict[int, tuple[int, int, Future]] = {}
        """call id -> (rank, incarnation, future)."""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._calls)

    def register(self, rank: int, incarnation: int, future: Future) -> int:
        with self._lock:
            call_id = next(self._ids)
            self._calls[call_id] = (rank, incarnation, future)
        return call_id

    def discard(self, call_ids: list[int]) -> None:
        with self._lock:
            for call_id in call_ids:
                self._calls.pop(call_id, None)

    def resolve(self, output: UtilityOutput) -> None:
        """Complete the future waiting for this answer; a caller that already gave up is fine."""
        with self._lock:
            entry = self._calls.pop(output.call_id, None)
        if entry is None:
            return
        future = entry[2]
        try:
            if output.failure_message is not None:
                future.set_exception(RuntimeError(output.failure_message))
            else:
                future.set_result(output.result)
        except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
            # the caller cancelled it; a failure is still worth a line in the log
            if output.failure_message is not None:
                logger.info("cancelled utility call %d failed: %s", output.call_id, output.failure_message)

    def fail(
        self, error: BaseException, rank: int | None = None, up_to_incarnation: int | None = None
    ) -> None:
        """Fail the calls sent to `rank` (every rank when None) up to that incarnation (any when None)."""
        with self._lock:
            failed = [
                call_id
                for call_id, (owner, incarnation, _) in self._calls.items()
                if (rank is None or owner == rank)
                and (up_to_incarnation is None or incarnation <= up_to_incarnation)
            ]
            futures = [self._calls.pop(call_id)[2] for call_id in failed]
        for future in futures:
            fail_future(future, error)
