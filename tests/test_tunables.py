"""``ingestd run`` execs itself once with glibc's non-temporal threshold (ingestd.service.tunables)."""
from __future__ import annotations

from pathlib import Path

import pytest

from daemon_proc import DaemonProc, descendants
from ingestd.service.tunables import THRESHOLD, TUNABLE, applies, with_copy_tunable

OURS = f"{TUNABLE}={THRESHOLD}"
needs_glibc = pytest.mark.skipif(not applies(), reason="the tunable means something only to glibc on x86-64 Linux")


def test_the_threshold_is_added_to_what_is_there_and_a_users_own_is_kept():
    assert with_copy_tunable("") == OURS
    assert with_copy_tunable("glibc.malloc.tcache_count=0") == f"glibc.malloc.tcache_count=0:{OURS}"
    own = f"glibc.malloc.tcache_count=0:{TUNABLE}=0x20000"
    assert with_copy_tunable(own) == own
    assert with_copy_tunable(f"{TUNABLE}x=1") == f"{TUNABLE}x=1:{OURS}"  # another name, not ours


def environ_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")


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
