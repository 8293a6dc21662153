"""The errors the frontend raises about the engine core."""

from __future__ import annotations

import signal


class EngineGenerateError(Exception):
    """A single request failed inside the engine; the engine itself lives on."""


class EngineDeadError(Exception):
    """The engine core is gone; no request can be served until the client is rebuilt.

    When the cause is known it is carried as fields: the engine rank, its exit code (negative: killed
    by that signal), and the type, message and traceback tail of the exception that ended it. `str()`
    says all but the traceback in one line; the traceback tail is attached as a note, so it is printed
    with the frontend's own traceback.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        engine_rank: int | None = None,
        exit_code: int | None = None,
        exc_type: str | None = None,
        exc_message: str | None = None,
        traceback_tail: str = "",
    ) -> None:
        self.base_message = message
        self.engine_rank = engine_rank
        self.exit_code = exit_code
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.traceback_tail = traceback_tail
        super().__init__(str(self))
        if traceback_tail:
            self.add_note(f"Engine core traceback (tail):\n{traceback_tail.rstrip()}")

    @property
    def signal(self) -> str | None:
        """The name of the signal that killed the engine, if one did."""
        if self.exit_code is None or self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return f"signal {-self.exit_code}"

    def __str__(self) -> str:
        if self.engine_rank is None and self.exc_type is None and self.exit_code is None:
            return self.base_message or "Engine core is dead; see the engine's log for the cause."
        who = "Engine core" if self.engine_rank is None else f"Engine core {self.engine_rank}"
        parts = [self.base_message or f"{who} is dead"]
        if self.signal is not None:
            parts.append(f"killed by {self.signal}")
        elif self.exit_code is not None:
            parts.append(f"exit code {self.exit_code}")
        line = "; ".join(parts)
        if self.exc_type is not None:
            line += f": {self.exc_type}: {self.exc_message}" if self.exc_message else f": {self.exc_type}"
        return line.replace("\n", " ")

    def __reduce__(self):
        kwargs = dict(
            engine_rank=self.engine_rank,
            exit_code=self.exit_code,
            exc_type=self.exc_type,
            exc_message=self.exc_message,
            traceback_tail=self.traceback_tail,
        )
        return (_rebuild_dead_error, (type(self), self.base_message, kwargs))


class EngineStartupError(EngineDeadError):
    """An engine core died or gave up before it became ready."""


def _rebuild_dead_error(cls: type[EngineDeadError], message: str | None, kwargs: dict) -> EngineDeadError:
    return cls(message, **kwargs)
