"""Audit events: metadata about what happened, never payloads.

An event carries ids, uids, pids, counts, durations, statuses and error
codes. Never a command's text, its output, file contents or credentials:
the fields are typed here, and strings are escaped and length-capped so a
hostile value cannot forge a record.
"""

import time

from attrs import field, frozen
from twisted.logger import Logger

#: Longest string value kept in an event; longer ones are cut and marked.
MAX_STRING = 256

_ALLOWED_TYPES = (str, int, float, bool, type(None))


def _clean(value):
    if isinstance(value, str):
        value = value.encode("ascii", "backslashreplace").decode("ascii")
        value = "".join(c if c.isprintable() else repr(c)[1:-1] for c in value)
        return value if len(value) <= MAX_STRING else value[: MAX_STRING - 3] + "..."
    if not isinstance(value, _ALLOWED_TYPES):
        raise TypeError(f"audit field of type {type(value).__name__} is not metadata")
    return value


def _clean_fields(fields: dict) -> dict:
    return {name: _clean(value) for name, value in fields.items()}


@frozen
class AuditEvent:
    """One thing that happened: its kind, when, and metadata fields."""

    kind: str
    fields: dict = field(converter=_clean_fields)
    time: float = field(factory=time.time)

    def as_dict(self) -> dict:
        """The event as one flat JSON-ready mapping."""
        return {"time": round(self.time, 6), "event": self.kind, **self.fields}


class Auditor:
    """Sends every event to every configured sink; a failing sink is logged, not fatal."""

    log = Logger()

    def __init__(self, sinks):
        self.sinks = list(sinks)

    def emit(self, kind: str, **fields) -> AuditEvent:
        """Record an event of ``kind`` with metadata ``fields``."""
        event = AuditEvent(kind, fields)
        for sink in self.sinks:
            try:
                sink.emit(event)
            except Exception:
                self.log.failure("audit sink {sink} failed", sink=sink.name)
        return event

    def close(self):
        """Close every sink; returns a Deferred firing when all are closed."""
        from twisted.internet.defer import gatherResults, maybeDeferred

        return gatherResults(
            [maybeDeferred(sink.close) for sink in self.sinks], consumeErrors=True
        )
