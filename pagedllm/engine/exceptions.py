"""Errors of the engine front end (``AsyncLLM``) and its engine-core clients."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The EngineCore (its process or thread) has died or failed; it cannot serve requests.

    Raised by every in-flight ``AsyncLLM.generate`` and by every later call that needs
    the engine. The engine does not restart: the front end must be shut down and a new
    one created. The message says why the engine stopped when that is known (the
    engine's own exception, or the process exit code); ``__cause__`` carries the engine's
    traceback text when it reported one.
    """

    def fresh(self) -> "EngineDeadError":
        """A new instance with the same message and cause. Raise this rather than a
        shared instance: each ``raise`` of one instance lengthens its traceback."""
        error = EngineDeadError(*self.args)
        error.__cause__ = self.__cause__
        return error


class EngineSleepingError(RuntimeError):
    """The engine is asleep (``sleep``, vLLM's sleep mode): it takes no request until
    ``wake_up``. Raised when a request is added; the OpenAI server answers it with 503."""


class EngineStartupError(RuntimeError):
    """The EngineCore failed while starting (loading the model, sizing the KV cache).

    A ``ValueError`` raised by the engine at start-up (bad argument, unsupported
    architecture, KV budget too small) is re-raised as ``ValueError`` with the same
    message instead; this class covers the rest (the process crashed, or another
    exception type). ``remote_traceback`` holds the engine's traceback text, if any.
    """

    def __init__(self, message: str, remote_traceback: str | None = None) -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback
