"""``ingestctl``: control a running ingestd from a shell or a script.

Exit codes (sysexits.h, so scripts can tell what went wrong):

==  =========================================================================
0   success
1   the daemon refused the command (an error reply that will not go away by retrying)
64  usage error (bad arguments)
65  the input file is not usable (push-weights: not a state dict of tensors)
66  the input file does not exist or cannot be read
69  no daemon: no reply within the timeout (not running, wrong address, no access), or, at
    once, no socket file at an ipc:// address, or one nothing listens on
73  keygen: cannot write the key files (they exist: use --force; or --dir does not exist)
75  temporary failure: the daemon replied timeout, busy or unavailable; retrying may work
76  the reply was not understood (not an ingestd socket, or a version mismatch)
141 stdout was closed early (``ingestctl status | head -1``): nothing more is printed, as when
    SIGPIPE ends ``git`` or ``systemctl`` (a shell shows 128 + 13 for them)
==  =========================================================================

With ``--json`` every command prints exactly one JSON object on stdout
(``{"ok": true, "result": ...}`` or ``{"ok": false, "error": {"code", "message"}}``),
except ``events``, which prints one JSON object per event and line.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from typing import Any, Callable

from ingestd.control.commands import MAX_WAIT_S
from ingestd.control.torchfile import EX_DATAERR, EX_NOINPUT, InputError, load_state_dict
from ingestd.errors import CommandFailed, DaemonUnavailable

EX_OK, EX_FAILED, EX_USAGE = 0, 1, 64  # EX_DATAERR 65 and EX_NOINPUT 66: torchfile
EX_UNAVAILABLE, EX_CANTCREAT, EX_TEMPFAIL, EX_PROTOCOL = 69, 73, 75, 76
EX_PIPE = 128 + 13  # what a shell reports for a command SIGPIPE ended (Python ignores SIGPIPE)


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would exit 2; scripts expect EX_USAGE
        raise UsageError(f"{self.prog}: {message}")


def _global_options(p: argparse.ArgumentParser, defaults: bool) -> None:
    """The options every command takes, before the command or after it (``ingestctl status
    --json``). After it they have no defaults, so they override only when given."""
    def default(value):
        return value if defaults else argparse.SUPPRESS
    p.add_argument("--connect", metavar="ADDR", default=default(None),
                   help="control address (default: $INGESTD_CONTROL, else the ipc socket in the daemon's runtime dir)")
    p.add_argument("--timeout", type=float, default=default(5.0), metavar="S",
                   help="seconds to wait for a reply (5), on top of any --wait for workers")
    p.add_argument("--json", action="store_true", default=default(False), help="print stable JSON instead of text")
    p.add_argument("--server-key", metavar="FILE", default=default(None),
                   help="CURVE: the daemon's public key file (tcp:// only)")
    p.add_argument("--client-key", metavar="FILE", default=default(None),
                   help="CURVE: this client's .key_secret file (tcp:// only)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ingestctl", description="Control a running ingestd daemon.")
    _global_options(p, defaults=True)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("ping", help="check that the daemon answers")
    sub.add_parser("status", help="workers, replay fill and weights version")
    sub.add_parser("config", help="the effective config")
    for name in ("pause", "resume"):
        cmd = sub.add_parser(name, help=f"{name} every worker and wait for all of them to acknowledge")
        cmd.add_argument("--wait", type=float, metavar="S", help="acknowledgement deadline (default 10)")
    cmd = sub.add_parser("restart", help="restart all workers, or the listed ones")
    cmd.add_argument("workers", nargs="*", type=int, metavar="W")
    cmd.add_argument("--no-wait", action="store_true", help="reply once the restart is requested")
    cmd.add_argument("--wait", type=float, metavar="S", help="deadline for the workers to come back (default 10)")
    cmd = sub.add_parser("scale", help="run N workers")
    cmd.add_argument("n", type=int, metavar="N")
    cmd.add_argument("--no-wait", action="store_true")
    cmd.add_argument("--wait", type=float, metavar="S")
    cmd = sub.add_parser("push-weights", help="push a state dict file (torch.save) as new policy weights")
    cmd.add_argument("file", metavar="FILE")
    cmd.add_argument("--key", metavar="NAME", help="the checkpoint entry holding the state dict (a "
                     "{'model': ..., 'optim': ...} file); default: the file itself, or its 'state_dict' entry")
    cmd.add_argument("--no-wait", action="store_true", help="reply once published, not once applied")
    cmd.add_argument("--wait", type=float, metavar="S")
    sub.add_parser("reload", help="re-read the daemon's config file (systemd ExecReload)")
    cmd = sub.add_parser("limiter", help="show the replay rate limiter, or change it live")
    cmd.add_argument("--spi", type=float, dest="samples_per_insert", help="samples per insert")
    cmd.add_argument("--min-diff", type=float, dest="min_diff")
    cmd.add_argument("--max-diff", type=float, dest="max_diff")
    cmd.add_argument("--min-size", type=int, dest="min_size")
    switch = cmd.add_mutually_exclusive_group()
    switch.add_argument("--enable", dest="enabled", action="store_true", default=None)
    switch.add_argument("--disable", dest="enabled", action="store_false")
    cmd.add_argument("--wait", type=float, metavar="S",
                     help="how long a change retries a limiter file a trainer holds (default 10)")
    cmd = sub.add_parser("profile", help="record a torch profiler trace of worker W; prints the trace path")
    cmd.add_argument("worker", type=int, metavar="W")
    cmd.add_argument("--seconds", type=float, default=None, metavar="S",
                     help="how long to record (1; at most 30: a second of a busy worker is a ~100 MB trace)")
    cmd = sub.add_parser("snapshot", help="copy the replay's committed rows into <data_dir>/snapshots/NAME "
                                          "(default NAME: the UTC time) while the workers keep collecting")
    cmd.add_argument("name", nargs="?", metavar="NAME", help="letters, digits, '.', '_', '-' (not starting with '.')")
    cmd.add_argument("--wait", type=float, metavar="S", help="how long to wait for it (default 300)")
    cmd = sub.add_parser("events", help="follow the event stream")
    cmd.add_argument("--events", metavar="ADDR", help="event address (default: asked from the daemon)")
    cmd.add_argument("--topic", action="append", default=[], help="topic prefix to follow (repeatable)")
    cmd.add_argument("--count", type=int, metavar="N", help="exit after N events")
    cmd.add_argument("--duration", type=float, metavar="S", help="exit after S seconds")
    cmd = sub.add_parser("keygen", help="write a CURVE key pair: NAME.key (public) and NAME.key_secret (0600)")
    cmd.add_argument("name", metavar="NAME")
    cmd.add_argument("--dir", default=".", help="directory to write to; it must exist (default: .)")
    cmd.add_argument("--force", action="store_true", help="overwrite existing files")
    for cmd in sub.choices.values():
        _global_options(cmd, defaults=False)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a reader gone early is found while it can be caught
        return code
    except BrokenPipeError:  # `ingestctl status | head -1`: the reader has what it wanted; exit silently
        _drop_stdout()
        return EX_PIPE


def _drop_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so that the interpreter's last flush of what
    is still buffered does not print "Exception ignored ... BrokenPipeError" at exit."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's stand-in): nothing to flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _main(argv: list[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
    except UsageError as exc:  # --json promises one JSON document, even for a command line it cannot parse
        return Output("--json" in (sys.argv[1:] if argv is None else argv)).error("usage", str(exc), EX_USAGE)
    from ingestd.errors import BadReply, BadWeights, CommandFailed, DaemonUnavailable
    from ingestd.control.curve import KeyFileError
    from ingestd.control.protocol import ErrorCode

    out = Output(args.json)
    try:
        _check_numbers(args)
        if args.command == "keygen":
            return _keygen(args, out)
        client = _client(args)
        try:
            return COMMANDS[args.command](client, args, out)
        finally:
            client.close()
    except CommandFailed as exc:
        retryable = exc.code in {c.value for c in ErrorCode if c.retryable}
        return out.error(exc.code, exc.message, EX_TEMPFAIL if retryable else EX_FAILED, exc.details)
    except DaemonUnavailable as exc:
        return out.error("daemon_unavailable", str(exc), EX_UNAVAILABLE)
    except BadReply as exc:
        return out.error("bad_reply", str(exc), EX_PROTOCOL)
    except BadWeights as exc:  # raised locally, while encoding: the daemon never saw it
        return out.error("bad_input", str(exc), EX_DATAERR)
    except KeyFileError as exc:
        return out.error("bad_key", str(exc), EX_NOINPUT)
    except UsageError as exc:
        return out.error("usage", str(exc), EX_USAGE)
    except InputError as exc:
        return out.error(exc.code, str(exc), exc.exit_code)
    except KeyboardInterrupt:
        return 130


class Output:
    """Text for people, one stable JSON document for scripts."""

    def __init__(self, as_json: bool):
        self.as_json = as_json

    def ok(self, result: Any, text: str | Callable[[], str]) -> int:
        if self.as_json:
            print(json.dumps({"ok": True, "result": result}, sort_keys=True))
        else:
            print(text() if callable(text) else text)
        return EX_OK

    def error(self, code: str, message: str, exit_code: int, details: dict | None = None) -> int:
        if self.as_json:
            print(json.dumps({"ok": False, "error": {**(details or {}), "code": code, "message": message}},
                             sort_keys=True))
        print(f"ingestctl: {code}: {message}", file=sys.stderr)
        return exit_code


SECONDS_OPTIONS = ("timeout", "wait", "seconds", "duration")
FINITE_OPTIONS = ("samples_per_insert", "min_diff", "max_diff")


def _check_numbers(args) -> None:
    """Refuse what ``float()`` lets through but no command can use: nan, inf, and seconds <= 0;
    and an ``events --count`` below 1, which would exit at once having shown nothing."""
    if getattr(args, "count", None) is not None and args.count < 1:
        raise UsageError(f"ingestctl: --count must be a number of events >= 1, got {args.count}")
    for name in SECONDS_OPTIONS + FINITE_OPTIONS:
        value = getattr(args, name, None)
        if value is None:
            continue
        option = "--" + ("spi" if name == "samples_per_insert" else name.replace("_", "-"))
        if name in SECONDS_OPTIONS and not 0 < value < math.inf:
            raise UsageError(f"ingestctl: {option} must be a finite number of seconds > 0, got {value:g}")
        if not math.isfinite(value):
            raise UsageError(f"ingestctl: {option} must be a finite number, got {value:g}")
        if name == "wait" and args.command != "snapshot" and value > MAX_WAIT_S:
            raise UsageError(f"ingestctl: {option} must be at most {MAX_WAIT_S:g} seconds (the daemon waits for "
                             f"workers no longer), got {value:g}")


def _client(args):
    from ingestd.control.client import ControlClient, CurveKeys

    keys = None
    if args.server_key or args.client_key:
        if not (args.server_key and args.client_key):
            raise UsageError("ingestctl: CURVE needs both --server-key and --client-key")
        keys = CurveKeys.load(args.server_key, args.client_key)
    try:
        return ControlClient(args.connect, timeout=args.timeout, curve_keys=keys, wait_for_socket=False)
    except Exception as exc:  # a malformed $INGESTD_CONTROL or --connect
        raise UsageError(f"ingestctl: {exc}") from None


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _list(items: list) -> str:
    return ", ".join(str(i) for i in items) or "none"


def _ping(client, args, out: Output) -> int:
    r = client.ping()
    return out.ok(r, f"pong from pid {r['pid']} (ingestd {r['version']}, protocol v{r['protocol']})")


def _status(client, args, out: Output) -> int:
    import dataclasses

    from ingestd.control.client import metrics_url
    from ingestd.control.commands import GetStatus, Status

    raw = client.call(GetStatus())

    def text() -> str:
        status = Status.from_json(raw)  # a wildcard metrics bind, shown where this client reaches it
        return format_status(dataclasses.replace(status, metrics_url=metrics_url(status.metrics_url, client.address)))
    return out.ok(raw, text)


_HOLDS_WEIGHTS = frozenset(("running", "paused", "stopping"))  # a process that applied weights (not starting, failed)


def format_status(s) -> str:
    rows = [("WORKER", "STATE", "PID", "FRAMES", "FRAMES/S", "EPISODES", "LAST RETURN", "RESTARTS", "WEIGHTS",
             "HEARTBEAT")]
    for w in s.workers:
        state = f"{w.state} ({w.pause_reason})" if w.pause_reason and w.pause_reason != "requested" else w.state
        rows.append((str(w.index), state, str(w.pid or "-"), str(w.frames), f"{w.frames_per_s:.0f}",
                     str(w.episodes), "-" if w.last_return is None else f"{w.last_return:.2f}", str(w.restarts),
                     f"v{w.weights_version}" if w.state in _HOLDS_WEIGHTS else "-",
                     "-" if w.heartbeat_age_s is None else f"{w.heartbeat_age_s:.2f}s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    errors = [f"  worker {w.index}{'' if w.error_age_s is None else f' ({_ago(w.error_age_s)})'}: {w.error}"
              for w in s.workers if w.error]
    r = s.replay
    weights_at = f" ({s.weights_path})" if s.weights_path else ""
    lines += (["errors:", *errors] if errors else []) + [
        f"replay: {r.rows}/{r.capacity} rows, write_count {r.write_count} ({r.path})",
        f"weights: v{s.weights_version}{weights_at}; desired: {s.desired}; workers wanted: {s.count}; "
        f"uptime {s.uptime_s:.0f} s; pid {s.pid}",
    ] + ([] if s.metrics_url == "" else [f"metrics: {s.metrics_url or 'off'}"])  # "": an older daemon's reply
    return "\n".join(lines)


def _ago(seconds: float) -> str:
    """``12 s ago``, ``5 min ago``, ``3 h ago``, ``2 d ago``: when a worker's error was reported."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _config(client, args, out: Output) -> int:
    result = client.config()
    return out.ok(result, lambda: json.dumps(result, indent=2, sort_keys=True))


def _pause_resume(client, args, out: Output) -> int:
    acked = (client.pause if args.command == "pause" else client.resume)(timeout_s=args.wait)
    verb = "paused" if args.command == "pause" else "resumed"

    def text() -> str:
        said = f"{verb}: workers {_list(acked.workers)} acknowledged in {_ms(acked.seconds)}"
        try:  # what follows only explains the reply: a daemon gone since does not undo the pause
            workers = client.status().workers
        except (DaemonUnavailable, CommandFailed):
            return said
        # (a starting worker follows the desired state as it comes up; a failed or stopped one never)
        silent = [w for w in workers if w.index not in acked.workers and w.state in ("failed", "stopped")]
        if silent:  # (walkthrough review: "workers none acknowledged", exit 0, said nothing of why)
            were = "it was" if len(silent) == 1 else "they were"
            said += (f"; {', '.join(f'worker {w.index} is {w.state}' for w in silent)}: not collecting, so "
                     f"{were} not {verb} (`ingestctl status` says why; `ingestctl restart W` starts one again)")
        if args.command == "resume":  # acknowledged, yet a spent frame budget keeps them paused: say so
            held = _budget_held(workers)
            if held:
                said += (f"; workers {_list(held)} stay paused: workers.total_frames is reached (raise it and "
                         "restart the daemon to collect more)")
        return said
    return out.ok(acked.to_json(), text)


def _budget_held(workers, among: list[int] | None = None) -> list[int]:
    """Workers (of ``among``; ``workers``: ``status``' list) that a spent ``workers.total_frames``
    budget keeps paused: a resume does not start them (``status``' pause reason)."""
    return [w.index for w in workers if w.pause_reason == "budget" and (among is None or w.index in among)]


def _restart(client, args, out: Output) -> int:
    acked = client.restart(args.workers or None, wait=not args.no_wait, timeout_s=args.wait)
    return out.ok(acked.to_json(), f"restarted workers {_list(acked.workers)} in {_ms(acked.seconds)}")


def _scale(client, args, out: Output) -> int:
    if args.n < 0:
        raise UsageError("ingestctl: N must be >= 0")
    acked = client.scale(args.n, wait=not args.no_wait, timeout_s=args.wait)
    return out.ok(acked.to_json(), f"scaled to {args.n} worker(s) in {_ms(acked.seconds)}")


def _push(client, args, out: Output) -> int:
    state = load_state_dict(args.file, args.key)
    pushed = client.push_weights_detailed(state, wait=not args.no_wait, timeout_s=args.wait)

    def deferred() -> str:
        if not pushed.deferred:
            return ""
        # "apply it on resume" was a promise a resume cannot keep
        held = _budget_held(client.status().workers, pushed.deferred)
        waiting = [i for i in pushed.deferred if i not in held]
        said = f"; paused workers {_list(waiting)} apply it on resume" if waiting else ""
        if held:
            said += (f"; workers {_list(held)} are paused by workers.total_frames (reached): they apply it only "
                     "if they collect again (raise it and restart the daemon)")
        return said

    if args.no_wait:  # nothing was waited for, so "applied by workers none" would read as a failure
        return out.ok(pushed.to_json(), lambda: f"weights v{pushed.version}: published in {_ms(pushed.seconds)}; "
                                                f"workers apply it between chunks (not waited for){deferred()}")
    dropped = (f"; workers {_list(pushed.dropped)} died or stopped before applying it (they load it when they "
               "restart)" if pushed.dropped else "")
    return out.ok(pushed.to_json(), lambda: f"weights v{pushed.version}: applied by workers {_list(pushed.applied)} "
                                            f"in {_ms(pushed.seconds)}{deferred()}{dropped}")


def _profile(client, args, out: Output) -> int:
    done = client.profile(args.worker, args.seconds)
    return out.ok(done.to_json(), done.path)


def _limiter(client, args, out: Output) -> int:
    names = ("enabled", "min_size", "samples_per_insert", "min_diff", "max_diff")
    changes = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    s = client.limiter(timeout_s=args.wait, **changes)

    def text() -> str:
        lag = "-" if s.sampled_policy_lag is None else "/".join(f"{v:g}" for v in s.sampled_policy_lag)
        error = "error: none while disabled" if s.error is None else f"error {s.error:g}"
        refused = "" if s.reader_refusals == "" else f", {s.reader_refusals} samples refused at once"
        held = len(s.workers_blocked)
        held = f"{held} ({'worker' if held == 1 else 'workers'} {_list(s.workers_blocked)})" if held else "0"
        return (f"limiter {'enabled' if s.enabled else 'disabled'}: samples_per_insert {s.samples_per_insert:g}, "
                f"window [{s.min_diff:g}, {s.max_diff:g}], min_size {s.min_size}\n"
                f"{error} (inserts {s.inserts}, samples {s.samples}); workers held back: "
                f"{held}, {s.workers_blocked_s:.1f} s in total; readers waited "
                f"{s.reader_blocked_s:.1f} s{refused}; sampled policy lag min/mean/max {lag}")
    return out.ok(s.to_json(), text)


def _snapshot(client, args, out: Output) -> int:
    s = client.snapshot(args.name, timeout=args.wait)
    return out.ok(s.to_json(), f"snapshot {s.path}: {s.rows} rows of {s.capacity} ({s.skipped} left out while being "
                               f"written; write_count {s.write_count}), {s.bytes / 1e6:.1f} MB in {s.seconds:.1f} s")


def _reload(client, args, out: Output) -> int:
    r = client.reload()
    extra = f"; needs a daemon restart: {_list(r.not_applied)}" if r.not_applied else ""
    if r.config_file is None:
        what = ("no config file to re-read: the daemon runs on its embedded default config "
                "(started without --config; its --set overrides stay)")
    else:  # "": an older daemon that does not say which file
        what = f"reloaded {r.config_file}" if r.config_file else "reloaded"
    if r.authorized_keys is not None:
        extra += f"; authorised CURVE keys: {r.authorized_keys}"
    if r.authorized_keys_error:
        extra += f" (kept: {r.authorized_keys_error})"
    return out.ok(r.to_json(), f"{what}; applied: {_list(r.applied)}{extra}")


def _events(client, args, out: Output) -> int:
    from ingestd.control.client import EventStream, check_address

    if args.events:
        try:
            address = check_address(args.events)
        except ValueError as exc:
            raise UsageError(f"ingestctl: --events: {exc}") from None
    else:  # (as EventStream.of: refused if the events are only on another host's ipc socket)
        address = EventStream.address_of(client)
    deadline = None if args.duration is None else time.monotonic() + args.duration
    seen = 0
    with EventStream(address, tuple(args.topic) or ("",), curve_keys=client.curve_keys) as stream:
        if not out.as_json:
            print(f"following events from {address} (Ctrl-C to stop)", file=sys.stderr)
        while args.count is None or seen < args.count:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            event = stream.next(remaining)
            if event is None:
                continue
            seen += 1
            if out.as_json:
                print(json.dumps({"topic": event.topic, "event": event.data}, sort_keys=True), flush=True)
            else:
                fields = " ".join(f"{k}={v}" for k, v in event.data.items() if k not in ("v", "event", "time", "seq"))
                stamp = time.strftime("%H:%M:%S", time.localtime(event.data.get("time", 0)))
                print(f"{stamp} {event.topic} {fields}", flush=True)
    return EX_OK


def _keygen(args, out: Output) -> int:
    from ingestd.control.curve import keygen

    try:
        public, secret = keygen(args.dir, args.name, force=args.force)
    except FileExistsError as exc:
        return out.error("exists", f"{exc.filename} exists; use --force to overwrite it", EX_CANTCREAT)
    except FileNotFoundError:  # never created: a typo in --dir would leave the keys where nobody looks
        return out.error("no_directory", f"directory {args.dir} does not exist; create it first: "
                                         f"mkdir -m 700 {shlex.quote(args.dir)}", EX_CANTCREAT)
    except NotADirectoryError:
        return out.error("no_directory", f"{args.dir} is not a directory", EX_CANTCREAT)
    except OSError as exc:
        return out.error("cannot_write", f"cannot write keys in {args.dir}: {exc.strerror}", EX_CANTCREAT)
    except ValueError as exc:
        return out.error("usage", str(exc), EX_USAGE)
    result = {"public": os.path.abspath(public), "secret": os.path.abspath(secret)}
    return out.ok(result, f"public key: {result['public']} (give it to the daemon's authorized keys dir)\n"
                          f"secret key: {result['secret']} (mode 0600; keep it private)")


COMMANDS: dict[str, Callable[..., int]] = {
    "ping": _ping, "status": _status, "config": _config, "pause": _pause_resume, "resume": _pause_resume,
    "restart": _restart, "scale": _scale, "push-weights": _push, "reload": _reload, "events": _events,
    "profile": _profile, "limiter": _limiter, "snapshot": _snapshot,
}


if __name__ == "__main__":
    sys.exit(main())
