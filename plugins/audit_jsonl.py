"""Audit sink ``jsonl``: one JSON object a line, appended to a file.

``CORRAL_AUDIT=jsonl:/var/log/corral/audit.jsonl``. Each event is one
``write`` on a descriptor opened with ``O_APPEND``, so lines from concurrent
writers never interleave and a crash loses at most the event being written.
"""

import json
import os

from zope.interface import implementer

from supervisor.hookspecs import hookimpl
from supervisor.interfaces import IAuditSink


@implementer(IAuditSink)
class JsonlAuditSink:
    """Appends events to ``path``, creating it (mode 0640) and its directory."""

    name = "jsonl"

    def __init__(self, path: str):
        if not os.path.isabs(path):
            raise ValueError(f"the audit file must be an absolute path, got {path!r}")
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
        self.path = path
        self._fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640
        )

    def emit(self, event) -> None:
        """Append one line for ``event``."""
        line = json.dumps(event.as_dict(), ensure_ascii=True, sort_keys=True) + "\n"
        os.write(self._fd, line.encode("ascii"))

    def close(self) -> None:
        """Close the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _build(argument, config):
    path = argument or os.path.join(config.state_dir, "audit.jsonl")
    return JsonlAuditSink(path)


@hookimpl
def corral_audit_sinks():
    """Offer the ``jsonl`` sink."""
    return {"jsonl": _build}
