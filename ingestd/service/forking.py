"""Worker processes forked the way ``multiprocessing``'s fork context does, except that a fork
that fails closes what it opened.

``multiprocessing.popen_fork.Popen`` opens two pipes before ``os.fork()`` and leaks them when
the fork (EAGAIN: the process limit; ENOMEM) or the second pipe (EMFILE) fails: four
descriptors per failed start, and the supervisor retries failed starts. Short of descriptors
is exactly when a leak hurts most.

The child dies with the daemon from its first instruction on: ``PDEATHSIG`` is set right after
the fork, not in the worker's setup ~10 ms later (a daemon SIGKILLed in between left 1 worker
in 10 running, writing into the replay the next daemon took, lifecycle review), and a child
whose parent died before that exits.

The child's side is otherwise the stdlib's, version for version (``test_supervisor`` checks that an
``atexit`` handler a worker registers runs, or not, as with the stdlib's fork context).
"""
from __future__ import annotations

import atexit
import ctypes
import multiprocessing as mp
import os
import signal
import sys
from multiprocessing import popen_fork, util

_HONOR_ATEXIT = sys.version_info >= (3, 13)
_PR_SET_PDEATHSIG = 1
try:  # resolved here, in the parent: the child calls it straight after the fork
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def die_with(parent: int) -> None:
    """In a child just forked from ``parent`` (its forking thread): be SIGKILLed when it dies,
    even by SIGKILL. The kernel sends nothing for a death before the ``prctl``: then the
    child has been re-parented, and exits at once."""
    if _prctl is None:
        return
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


class _Popen(popen_fork.Popen):
    def _launch(self, process_obj) -> None:
        opened: list[int] = []
        try:
            parent_r, child_w = _pipe(opened)
            child_r, parent_w = _pipe(opened)
            parent = os.getpid()
            self.pid = os.fork()
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        if self.pid == 0:
            code = 1
            try:
                die_with(parent)
                if _HONOR_ATEXIT:  # as the stdlib child does from 3.13 (gh-83856): the child's own handlers run
                    atexit._clear()
                    atexit.register(util._exit_function)
                os.close(parent_r)
                os.close(parent_w)
                code = process_obj._bootstrap(parent_sentinel=child_r)
            finally:
                if _HONOR_ATEXIT:
                    atexit._run_exitfuncs()
                os._exit(code)
        os.close(child_w)
        os.close(child_r)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_r, parent_w))
        self.sentinel = parent_r


def _pipe(opened: list[int]) -> tuple[int, int]:
    read, write = os.pipe()
    opened += (read, write)
    return read, write


class _Process(mp.get_context("fork").Process):
    @staticmethod
    def _Popen(process_obj):  # noqa: N802 - multiprocessing's name
        return _Popen(process_obj)


class ForkContext:
    """What the supervisor needs of a multiprocessing context: ``Process``."""

    Process = _Process
