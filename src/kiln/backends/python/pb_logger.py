"""pb_utils' ``Logger``: a model's log lines, in the server's log (re-exported by
``pb_utils``)."""

from __future__ import annotations

import enum
import sys

from kiln.backends.python.pb_errors import TritonModelException

__all__ = ["Logger"]


class _LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


class Logger:
    """``pb_utils.Logger.log_info(...)`` or ``Logger.log(message, Logger.WARNING)``: lines
    land in the server's log, each with its level."""

    __module__ = "kiln.backends.python.pb_utils"  # pb_utils' API, where it was defined

    LogLevel = _LogLevel
    INFO, WARNING, ERROR, VERBOSE = _LogLevel

    @classmethod
    def log(cls, message: str, level: int = _LogLevel.INFO) -> None:
        try:
            name = _LogLevel(level).name
        except ValueError:
            raise TritonModelException(
                f"Logger.log: unknown level {level!r} (Logger.INFO, WARNING, ERROR, VERBOSE)"
            ) from None
        # The worker's stderr is the server's: one line per message, as Triton logs them.
        print(f"{name}: {message}", file=sys.stderr, flush=True)

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.log(message, _LogLevel.INFO)

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.log(message, _LogLevel.WARNING)

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.log(message, _LogLevel.ERROR)

    @classmethod
    def log_verbose(cls, message: str) -> None:
        cls.log(message, _LogLevel.VERBOSE)
