"""Logging for every hostd process: the journal's native protocol under
systemd, plain stderr by hand.

One job: one call, setup(model, component), after which every record carries
HOSTD_MODEL= (and HOSTD_COMPONENT=; HOSTD_OPERATION= and HOSTD_STAGE= when the
caller passes them in `extra`), so `journalctl HOSTD_MODEL=NAME` follows one
model across all its units. A record may set a fixed MESSAGE_ID through
extra={"message_id": ...}.

A running process changes its level on a signal (LEVEL_SIGNALS: one
real-time signal per level, as systemd's PID 1 takes SIGRTMIN+22 for debug
and SIGRTMIN+23 for info): setup() installs the handler, so every hostd
process (gateway, engine and its vLLM/SGLang supervisor, weights daemon,
manager) takes it the same way. The manager sends them through systemd's
KillUnit to the unit's main process only (Model.SetLogLevel); a level set so
lasts for that process, and its next start reads hostd.yaml's log_level
again. Trust: any process that may signal this one (root, its own uid) may
change its level, and nothing else: the signal carries no data.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

from logging_journald import JournaldLogHandler, check_journal_stream

FIELD_PREFIX = "hostd_"

# hostd.yaml's log_level values (config/schema.py), and the signal that sets
# each in a running process: SIGRTMIN + offset. Real-time signals, because a
# signal is all that reaches every role the same way (the weights daemon has
# no HTTP route, upstream's supervisors no control socket), and one signal a
# level needs no file beside it. The offsets avoid systemd's own
# (SIGRTMIN+20..+26 to PID 1) so that a mistyped `systemctl kill` target is
# at least not PID 1's meaning. A process that has not installed the handler
# yet would die of one (their default action): the manager signals only
# units that are active, that is, past READY=1 and long past setup().
LEVEL_SIGNALS = {"debug": 10, "info": 11, "warning": 12, "error": 13}


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
    listen_for_levels()


def level_signal(level: str) -> int:
    """The signal that sets LEVEL ("debug", "info", "warning", "error") in a running hostd process."""
    return signal.SIGRTMIN + LEVEL_SIGNALS[level]


def listen_for_levels() -> None:
    """Take LEVEL_SIGNALS from now on (signal handlers belong to the main
    thread: elsewhere, e.g. a test calling setup() from a thread, nothing)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for level in LEVEL_SIGNALS:
        signal.signal(level_signal(level), _on_level_signal)


def _on_level_signal(signum: int, _frame) -> None:
    level = next(name for name in LEVEL_SIGNALS if level_signal(name) == signum)
    set_level(level, "a signal (hostctl log-level)")


def set_level(level: str, source: str) -> None:
    """LEVEL for this process's hostd loggers now, and one INFO line that
    says so, written while INFO still shows (before a rise to warning or
    error, after a drop to info or debug)."""
    root = logging.getLogger()
    new = getattr(logging, level.upper())
    before = logging.getLevelName(root.level).lower()

    def say() -> None:
        logging.getLogger("hostd.logs").info("log level %s (was %s), set by %s", level, before, source)

    if new > logging.INFO:
        say()
    root.setLevel(new)
    if new <= logging.INFO:
        say()


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
