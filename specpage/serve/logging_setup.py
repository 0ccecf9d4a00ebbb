"""Structured logs: one JSON object per line, for journald and log shippers.

Every line has ts, level, logger and msg; fields passed with ``extra=`` (such as
``request_id``) are added as they are, an exception as ``exc``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any

# Attributes every LogRecord has; anything else on a record came from extra=.
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in line:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        # default=str: an odd extra value must not cost the log line.
        return json.dumps(line, default=str, ensure_ascii=False)


def configure_logging(level: str, stream: IO[str] | None = None) -> logging.Handler:
    """Send the root logger's records at level and above to stream (stderr) as JSON.

    Calling it again replaces the handler it installed before, and only that one,
    so handlers others put on the root logger (pytest's, for one) stay.
    """
    root = logging.getLogger()
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}")
    for old in [h for h in root.handlers if isinstance(h.formatter, JsonFormatter)]:
        root.removeHandler(old)
        old.close()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root.addHandler(handler)
    root.setLevel(numeric)
    return handler
