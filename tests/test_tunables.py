"""``ingestd run`` execs itself once with glibc's non-temporal threshold (ingestd.service.tunables)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from daemon_proc import DaemonProc, descendants, environ_of, wait_for
from ingestd.service.tunables import THRESHOLD, TUNABLE, applies, with_copy_tunable

OURS = f"{TUNABLE}={THRESHOLD}"
needs_glibc = pytest.mark.skipif(not applies(), reason="the tunable means something only to glibc on x86-64 Linux")


def test_the_threshold_is_added_to_what_is_there_and_a_users_own_is_kept():
    assert with_copy_tunable("") == OURS
    assert with_copy_tunable("glibc.malloc.tcache_count=0") == f"glibc.malloc.tcache_count=0:{OURS}"
    own = f"glibc.malloc.tcache_count=0:{TUNABLE}=0x20000"
    assert with_copy_tunable(own) == own
    assert with_copy_tunable(f"{TUNABLE}x=1") == f"{TUNABLE}x=1:{OURS}"  # another name, not ours


LDSO = Path("/lib64/ld-linux-x86-64.so.2")


@needs_glibc
def test_glibc_takes_the_setting():
    """Not only the string: glibc's loader reads the threshold as set (a misspelled name, or a
    value under glibc's minimum, 0x4040 here, would be ignored without a word)."""
    if not LDSO.exists():
        pytest.skip(f"no {LDSO}")
    listed = subprocess.run([str(LDSO), "--list-tunables"], env={"GLIBC_TUNABLES": with_copy_tunable("")},
                            capture_output=True, text=True, timeout=30)
    if listed.returncode != 0:
        pytest.skip("this glibc's loader has no --list-tunables (before 2.33)")
    assert f"{TUNABLE}: {THRESHOLD} " in listed.stdout, listed.stdout


@needs_glibc
def test_an_exec_that_fails_leaves_the_process_as_it_was(tmp_path):
    """No interpreter to exec (argv[0] that names none), or an exec refused: the command goes on
    without the tunable, its environment and signal mask as they were."""
    code = ("import os, signal, sys; sys.executable = '/nonexistent/python'; "
            "from ingestd.service.tunables import exec_with_copy_tunable; exec_with_copy_tunable(); "
            "print(os.environ.get('GLIBC_TUNABLES'), signal.SIGHUP in signal.pthread_sigmask(signal.SIG_BLOCK, []))")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["None", "False"], (out.stdout, out.stderr)


@needs_glibc
@pytest.mark.parametrize("given,expected", [("", OURS), (f"{TUNABLE}=0x20000", f"{TUNABLE}=0x20000")],
                         ids=["added", "users-own"])
def test_a_daemon_started_without_the_threshold_runs_with_it_under_the_same_pid(given, expected):
    """An exec'd ``ingestd run`` whose environment lacks the threshold becomes, in the same
    process (the PID its parent and systemd know), one whose start-up environment has it; its
    workers have it too. One that names the threshold itself keeps its value."""
    with DaemonProc(overrides={"workers.count": 1}, env={"GLIBC_TUNABLES": given}, launch="exec") as d:
        d.wait_ready(timeout=60, rows=1)
        for pid in (d.proc.pid, *descendants(d.proc.pid)):
            assert f"GLIBC_TUNABLES={expected}" in environ_of(pid), pid
        assert d.stop() == 0, d.log()


@needs_glibc
def test_the_exec_keeps_sighup_blocked_across_it(tmp_path):
    """SIGHUP is blocked at the moment of the exec (a SIGHUP then stays pending into the new
    image instead of killing the process between the exec and its handler), and only then."""
    code = ("import os, signal, sys\n"
            "def execv(path, argv):\n"
            "    print('blocked' if signal.SIGHUP in signal.pthread_sigmask(signal.SIG_BLOCK, []) else 'open',"
            " os.environ.get('GLIBC_TUNABLES'), flush=True)\n"
            "    os._exit(0)\n"
            "print('before', signal.SIGHUP in signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)\n"
            "os.execv = execv\n"
            "from ingestd.service.tunables import exec_with_copy_tunable; exec_with_copy_tunable()\n"
            "print('not reached', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["before", "False", "blocked", OURS], (out.stdout, out.stderr)


class _SighupPendingAtStart(DaemonProc):
    """An exec'd daemon whose process starts with a SIGHUP pending and blocked: the state a
    SIGHUP sent inside the tunables' exec leaves (blocked by ``exec_with_copy_tunable``, it
    stays pending into the new image), made certain rather than raced for."""

    def args(self) -> list[str]:
        wrapper = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP}); "
                   "os.kill(os.getpid(), signal.SIGHUP); os.execv(sys.executable, sys.argv[1:])")
        return [sys.executable, "-c", wrapper, *super().args()]


@needs_glibc
def test_a_sighup_pending_across_the_exec_is_a_reload_not_an_exit():
    """The daemon execs itself for the tunable with the SIGHUP still pending; the new image's
    early handler takes it once in place (unblocking it), so the daemon neither dies of it nor
    loses it (the config changed after it was read: the deferred reload applies the change),
    and later SIGHUPs reach the daemon's own handler (SIGHUP is not left blocked)."""
    env = {"GLIBC_TUNABLES": ""}  # without the threshold: `run` execs itself
    with _SighupPendingAtStart(overrides={"workers.count": 1}, config_text="[workers]\nrestart_budget = 7\n",
                               env=env, launch="exec") as d:
        d.wait_ready(timeout=60, rows=1)
        wait_for(lambda: "a SIGHUP arrived while starting" in d.log(), 10, "the early SIGHUP's deferred reload")
        assert f"GLIBC_TUNABLES={OURS}" in environ_of(d.proc.pid)  # it did exec with the SIGHUP pending
        d.config_path.write_text("[workers]\nrestart_budget = 9\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload: applied workers.restart_budget" in d.log(), 10, "the later SIGHUP's reload")
        assert d.proc.poll() is None
        assert d.stop() == 0, d.log()
