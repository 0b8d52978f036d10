"""Structured logging: one JSON object a line for journald, or text on a terminal."""

import json
import sys
import time

from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    formatEvent,
    globalLogBeginner,
    textFileLogObserver,
)

_LEVELS = {
    "debug": LogLevel.debug,
    "info": LogLevel.info,
    "warn": LogLevel.warn,
    "error": LogLevel.error,
}
_SKIP = {"log_logger", "log_source", "log_format", "log_io", "log_time", "log_level",
         "log_namespace", "log_failure", "log_trace", "log_flattened"}


class JsonLineObserver:
    """Writes each event as a JSON line: time, level, namespace, message and named fields."""

    def __init__(self, out):
        self.out = out

    def __call__(self, event: dict) -> None:
        """Serialise one event; fields that are not JSON become their repr."""
        record = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(event.get("log_time", time.time())))
            + f".{int((event.get('log_time', 0) % 1) * 1000):03d}Z",
            "level": event["log_level"].name if "log_level" in event else "info",
            "namespace": event.get("log_namespace", ""),
            "message": formatEvent(event),
        }
        for key, value in event.items():
            if key in _SKIP or key.startswith("log_") or key in record:
                continue
            record[key] = value
        failure = event.get("log_failure")
        if failure is not None:
            record["traceback"] = failure.getTraceback()
        self.out.write(json.dumps(record, default=repr, ensure_ascii=False) + "\n")
        self.out.flush()


def start_logging(log_format: str, log_level: str, out=None) -> None:
    """Send Twisted's log to ``out`` (stdout) in the chosen format at the chosen level."""
    out = out or sys.stdout
    if log_format == "auto":
        log_format = "text" if out.isatty() else "json"
    observer = JsonLineObserver(out) if log_format == "json" else textFileLogObserver(out)
    predicate = LogLevelFilterPredicate(defaultLogLevel=_LEVELS[log_level])
    globalLogBeginner.beginLoggingTo(
        [FilteringLogObserver(observer, [predicate])], redirectStandardIO=False
    )
