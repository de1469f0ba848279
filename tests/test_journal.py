"""Log lines carry their syslog priority when stderr is the journal (``$JOURNAL_STREAM``)."""
from __future__ import annotations

import logging
import os
import re
import signal

from daemon_proc import DaemonProc, wait_for
from reliability_util import PLUGIN_ENV
from ingestd.service.journal import FORMAT, JournalFormatter, formatter_for, is_journal


def _record(level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord("ingestd.test", level, __file__, 1, message, None, None)


def test_each_line_of_a_record_carries_its_priority():
    f = JournalFormatter(FORMAT)
    assert f.format(_record(logging.ERROR, "marked failed")).startswith("<3>")
    assert f.format(_record(logging.WARNING, "w")).startswith("<4>")
    assert f.format(_record(logging.INFO, "i")).startswith("<6>")
    assert f.format(_record(logging.DEBUG, "d")).startswith("<7>")
    assert f.format(_record(logging.CRITICAL, "c")).startswith("<2>")
    lines = f.format(_record(logging.ERROR, "reload failed:\n  2 | count =\n    ^")).split("\n")
    assert len(lines) == 3 and all(line.startswith("<3>") for line in lines), lines


def test_only_the_stream_systemd_named_is_the_journal(tmp_path):
    with open(tmp_path / "a", "w") as a, open(tmp_path / "b", "w") as b:
        st = os.fstat(a.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert is_journal(a, env) and isinstance(formatter_for(a, env), JournalFormatter)
        assert not is_journal(b, env) and type(formatter_for(b, env)) is logging.Formatter  # another file
        for bad in ({}, {"JOURNAL_STREAM": ""}, {"JOURNAL_STREAM": "x:y"}, {"JOURNAL_STREAM": "12"}):
            assert not is_journal(a, bad), bad


def test_a_daemon_writing_to_the_journal_prefixes_its_lines():
    """Under the unit, `journalctl -u ingestd -p warning` showed nothing: every line went in
    as info (ops review). A failed reload's error and its TOML excerpt are priority 3."""
    d = DaemonProc(overrides={"workers.count": 1})
    d.log_path.touch()  # the file the daemon's stderr will be (start truncates it, same inode)
    st = os.stat(d.log_path)
    d.extra_env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    with d:
        d.wait_ready(rows=10)
        d.config_path.write_text("[workers]\ncount = \n")  # a TOML error: a message of several lines
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload failed" in d.log(), 10, "the failed reload in the log")
        assert d.stop() == 0
        lines = [line for line in d.log().splitlines() if line.strip()]  # (the log goes with the context)
    ours = [line for line in lines if re.match(r"<\d>\d{4}-\d\d-\d\d ", line)]
    assert any(line.startswith("<6>") and " INFO ingestd.daemon: ready" in line for line in ours), lines[:20]
    failed = next(i for i, line in enumerate(lines) if "reload failed" in line)
    assert lines[failed].startswith("<3>") and " ERROR " in lines[failed], lines[failed]
    assert lines[failed + 1].startswith("<3>") and "count =" in lines[failed + 1], lines[failed:failed + 3]
    logged = [line for line in lines if " ingestd." in line and re.search(r" (INFO|WARNING|ERROR|DEBUG) ", line)]
    assert all(re.match(r"<[2-7]>", line) for line in logged), [x for x in logged if not x.startswith("<")][:5]


def _journal_daemon(overrides: dict) -> DaemonProc:
    """A daemon whose stderr (its log file) is what ``$JOURNAL_STREAM`` names (and which
    imports the tests' env plug-ins)."""
    d = DaemonProc(overrides=overrides, env=PLUGIN_ENV)
    d.log_path.touch()  # start truncates it: the same inode
    st = os.stat(d.log_path)
    d.extra_env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    return d


def test_a_crashed_workers_traceback_is_stored_as_an_error():
    """A worker's crash and its traceback were printed past logging, so the journal stored them
    as info and `journalctl -p err` hid why workers died (ops review)."""
    overrides = {"workers.count": 2, "workers.env": "reliability_util:faulty_by_worker", "workers.policy": "Random",
                 "workers.restart_budget": 1, "workers.restart_backoff_s": 0.1, "metrics.enabled": False}
    with _journal_daemon(overrides) as d:  # worker 1 raises in its first step
        d.wait_ready(rows=10)
        wait_for(lambda: "ingestd worker 1 (pid" in d.log(), 20, "worker 1's failure in the log")
        assert d.stop() == 0
        lines = d.log().splitlines()
    first = next(i for i, line in enumerate(lines) if "ingestd worker 1 (pid" in line)
    assert lines[first].startswith("<3>") and "simulated env failure in step" in lines[first], lines[first]
    trace = lines[first + 1:first + 1 + next(i for i, line in enumerate(lines[first + 1:]) if "RuntimeError" in line) + 1]
    assert trace[0] == "<3>Traceback (most recent call last):" and len(trace) > 3, trace
    assert all(line.startswith("<3>") for line in trace), trace


def test_a_config_error_at_start_is_stored_as_an_error():
    """Printed before logging is set up, it went in as info (its exit status, 78, aside)."""
    with _journal_daemon({"workers.count": "two"}) as d:
        assert d.proc.wait(30) == 78
        lines = [line for line in d.log().splitlines() if line.strip()]
    assert lines and all(line.startswith("<3>ingestd: config error: ") for line in lines), lines
    assert "workers.count" in lines[0]
