"""Log lines as the journal reads them: each with its syslog priority when stderr is the journal.

systemd connects a service's stderr to the journal and says so in ``$JOURNAL_STREAM``
(``device:inode`` of that stream). A line beginning ``<N>`` (sd-daemon(3)) is stored with
priority N, so ``journalctl -u ingestd -p warning`` finds the daemon's warnings and errors;
without the prefix every line was stored as info. Each line of a multi-line message (a TOML
error's caret) carries the prefix, as each becomes an entry of its own. A crashed worker's
traceback is logged (each line priority err), and a config error printed before logging is
set up is prefixed too (``marked``); what is written past both (faulthandler's stacks of a
hung worker, from a signal handler) is not. Elsewhere (a terminal, a file, a test) lines are
left as they are.
"""
from __future__ import annotations

import logging
import os
from typing import TextIO

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# sd-daemon(3)'s SD_CRIT .. SD_DEBUG for Python's levels
PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


class JournalFormatter(logging.Formatter):
    """``FORMAT`` with every line prefixed by the record's syslog priority."""

    def format(self, record: logging.LogRecord) -> str:
        return _prefixed(super().format(record), record.levelno)


def marked(text: str, levelno: int, stream: TextIO, environ=os.environ) -> str:
    """``text`` as the journal should store it when written to ``stream``: each line prefixed
    with ``levelno``'s priority if ``stream`` is the journal (what is printed before logging is
    set up: a config error), else unchanged."""
    return _prefixed(text, levelno) if is_journal(stream, environ) else text


def _prefixed(text: str, levelno: int) -> str:
    prefix = f"<{priority(levelno)}>"
    return "\n".join(prefix + line for line in text.split("\n"))


def priority(levelno: int) -> int:
    return next((p for level, p in PRIORITIES if levelno >= level), 7)


def is_journal(stream: TextIO, environ=os.environ) -> bool:
    """Whether ``stream`` is the journal stream systemd named in ``$JOURNAL_STREAM``."""
    device, _, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino) == (int(device), int(inode))
    except (ValueError, OSError, AttributeError):  # unset, malformed, or no file descriptor
        return False


def formatter_for(stream: TextIO, environ=os.environ) -> logging.Formatter:
    return JournalFormatter(FORMAT) if is_journal(stream, environ) else logging.Formatter(FORMAT)
