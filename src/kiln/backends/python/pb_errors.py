"""pb_utils' errors: ``TritonError``, which a response carries, and ``TritonModelException``,
which the API raises (re-exported by ``pb_utils``)."""

from __future__ import annotations

__all__ = ["TritonError", "TritonModelException"]


class TritonError:
    """An error a response carries; ``code`` picks the status the client sees."""

    __module__ = "kiln.backends.python.pb_utils"  # pb_utils' API, where it was defined

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE = 0, 1, 2, 3, 4
    UNSUPPORTED, ALREADY_EXISTS, CANCELLED = 5, 6, 7

    def __init__(self, message: str, code: int = 1) -> None:
        self._message = str(message)
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r})"


class TritonModelException(Exception):
    # A model's failure reaches the client as its traceback's last line, which names the
    # class with its module: kiln.backends.python.pb_utils.TritonModelException, as before.
    __module__ = "kiln.backends.python.pb_utils"
