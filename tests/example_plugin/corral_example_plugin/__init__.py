"""An example third-party corral plugin: the audit sink ``tally``.

``CORRAL_AUDIT=tally:/path/to/file.json`` keeps a count of events by kind
and rewrites the file after every event. docs/plugins.md walks through it.
"""

import json
import os
from collections import Counter

from zope.interface import implementer

from supervisor.hookspecs import hookimpl
from supervisor.interfaces import IAuditSink


@implementer(IAuditSink)
class TallySink:
    """Counts audit events by kind into a JSON file."""

    name = "tally"

    def __init__(self, path):
        self.path = path
        self.counts = Counter()

    def emit(self, event):
        """Count ``event`` and rewrite the file atomically."""
        self.counts[event.kind] += 1
        temp = self.path + ".tmp"
        with open(temp, "w") as f:
            json.dump(dict(self.counts), f)
        os.replace(temp, self.path)

    def close(self):
        """Nothing to release."""


def _build(argument, config):
    if not argument:
        raise ValueError("tally needs a file: tally:/path/to/counts.json")
    return TallySink(argument)


@hookimpl
def corral_audit_sinks():
    """Offer the ``tally`` audit sink."""
    return {"tally": _build}
