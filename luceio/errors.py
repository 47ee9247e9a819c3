"""The engine's own errors, shared by its drivers and the server, which maps each to a status."""
from __future__ import annotations


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_queued_requests` allows."""


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (a pipeline stage died): it stays failed until the
    process restarts, so its users stop too (the server answers 503 and exits non-zero)."""
