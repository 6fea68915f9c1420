"""Logging set-up shared by every process: `--log-format text|json`.

JSON lines are built with json.dumps (messages and tracebacks escaped), one object per line:
time, level, logger, message, plus `exc` when an exception is attached and any `extra`
fields a caller passes (e.g. request_id, executor_id).
"""

from __future__ import annotations

import json
import logging
import sys

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                data[key] = value if isinstance(value, (str, int, float, bool)) else str(value)
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False)


def setup_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def progress_bars_enabled(fmt: str) -> bool:
    """Progress bars (tqdm) only for text logs: JSON logs stay one object per line."""
    return fmt != "json"
