"""Worker processes forked the way ``multiprocessing``'s fork context does, except that a fork
that fails closes what it opened.

``multiprocessing.popen_fork.Popen`` opens two pipes before ``os.fork()`` and leaks them when
the fork (EAGAIN: the process limit; ENOMEM) or the second pipe (EMFILE) fails: four
descriptors per failed start, and the supervisor retries failed starts. Short of descriptors
is exactly when a leak hurts most.

The child's side is the stdlib's, version for version (``test_supervisor`` checks that an
``atexit`` handler a worker registers runs, or not, as with the stdlib's fork context).
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import sys
from multiprocessing import popen_fork, util

_HONOR_ATEXIT = sys.version_info >= (3, 13)


class _Popen(popen_fork.Popen):
    def _launch(self, process_obj) -> None:
        opened: list[int] = []
        try:
            parent_r, child_w = _pipe(opened)
            child_r, parent_w = _pipe(opened)
            self.pid = os.fork()
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        if self.pid == 0:
            code = 1
            try:
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
