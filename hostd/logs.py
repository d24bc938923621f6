"""Logging for every hostd process: the journal's native protocol under
systemd, plain stderr by hand.

One job: one call, setup(model, component), after which every record carries
HOSTD_MODEL= (and HOSTD_COMPONENT=; HOSTD_OPERATION= and HOSTD_STAGE= when the
caller passes them in `extra`), so `journalctl HOSTD_MODEL=NAME` follows one
model across all its units. A record may set a fixed MESSAGE_ID through
extra={"message_id": ...}.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from logging_journald import JournaldLogHandler, check_journal_stream

FIELD_PREFIX = "hostd_"


class _ModelFields(logging.Filter):
    def __init__(self, model: str, component: str):
        super().__init__()
        self.model, self.component = model, component

    def filter(self, record: logging.LogRecord) -> bool:
        model = getattr(record, "hostd_model", self.model)
        if model:
            record.hostd_model = model
        record.hostd_component = self.component
        return True


class JournalHandler(JournaldLogHandler):
    """Sends hostd_* record attributes as top-level journal fields (the
    library would nest them under EXTRA_) and honours a fixed message_id."""

    def _format_record(self, record: logging.LogRecord) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for key, value in super()._format_record(record):
            if key == "extra":
                extra = dict(value)
                for name in [k for k in extra if k.startswith(FIELD_PREFIX)]:
                    out.append((name, extra.pop(name)))
                if extra.get("message_id"):
                    out.append(("message_id", extra.pop("message_id")))
                value = extra
            out.append((key, value))
        return out


def under_journal() -> bool:
    return bool(os.environ.get("JOURNAL_STREAM")) and check_journal_stream()


def setup(model: str, component: str, level: int = logging.INFO) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    if under_journal():
        # MESSAGE_ID only where hostd sets a fixed one (the library would hash every line).
        handler: logging.Handler = JournalHandler(identifier=f"hostd-{component}", use_message_id=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s hostd-{component}[{model}] %(levelname)s %(message)s")
        )
    handler.addFilter(_ModelFields(model, component))
    root.addHandler(handler)
    root.setLevel(level)
    # ContinuousBatchingLogger: transformers' batching loop, an INFO line per
    # start and stop of its thread (it pushed the demo's journal tail out).
    for noisy in ("urllib3", "filelock", "transformers", "ContinuousBatchingLogger"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def apply_level(level: str) -> None:
    """hostd.yaml's log_level ("debug", "info", ...) for this process's hostd
    loggers: read once the config is loaded (setup() runs before, so that a
    broken config is itself logged)."""
    logging.getLogger().setLevel(getattr(logging, level.upper()))


class _ProtocolErrors(logging.LoggerAdapter):
    """aiohttp's server logger, for a server any client reaches: a client's
    protocol error (a malformed request line, header or body encoding:
    aiohttp's HttpProcessingError) is one line at debug, never an ERROR with a
    traceback that a client could repeat to flood the journal or to plant text
    in it; anything else (a bug) keeps its traceback."""

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(error, HttpProcessingError):
            self.logger.debug("client protocol error (%s): %s", type(error).__name__, one_line(error))
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)


def protocol_logger(log: logging.Logger) -> logging.LoggerAdapter:
    """LOG, as the `logger=` of an aiohttp server (see _ProtocolErrors)."""
    return _ProtocolErrors(log, {})


def one_line(error: BaseException, limit: int = 200) -> str:
    """ERROR's message as one line of at most LIMIT characters (a client's text, made harmless)."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit] + "..."
