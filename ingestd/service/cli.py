"""``ingestd``: run the daemon, print or check its config, snapshot or restore a replay storage."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

EX_CONFIG = 78  # sysexits.h: configuration error
EX_TEMPFAIL = 75  # sysexits.h: temporary failure (another daemon holds the runtime dir)
EX_USAGE = 64  # sysexits.h: bad arguments (as ingestctl); the systemd unit does not retry it
EX_DATAERR, EX_NOINPUT, EX_CANTCREAT, EX_IOERR = 65, 66, 73, 74  # sysexits.h (`ingestd replay`)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would exit 2
        self.print_usage(sys.stderr)
        self.exit(EX_USAGE, f"{self.prog}: error: {message}\n")


def _override(text: str) -> str:
    """A ``--set`` argument. Its syntax (``section.key=value``) is checked here, so a malformed one
    is a usage error (exit 64) like any bad argument; its key and value are checked with the rest
    of the config (exit 78)."""
    from ingestd.service.config import split_override

    try:
        split_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ingestd", description="Experience-ingestion daemon for RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the daemon in the foreground (logs to stderr)")
    run.add_argument("--config", "-c", metavar="FILE", help="TOML config file (default: the embedded default)")
    run.add_argument("--set", dest="overrides", action="append", default=[], type=_override,
                     metavar="SECTION.KEY=VALUE",
                     help="override one config key (repeatable), e.g. --set workers.count=4")
    cfg = sub.add_parser("config", help="print the default config or the config reference, or check a config file")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    cfg_sub.add_parser("default", help="print the embedded default config (TOML)")
    cfg_sub.add_parser("reference", help="print the config reference (Markdown; docs/config.md is this output)")
    check = cfg_sub.add_parser("check", help="validate a config file; exit 78 if it is wrong")
    check.add_argument("file")
    check.add_argument("--set", dest="overrides", action="append", default=[], type=_override,
                       metavar="SECTION.KEY=VALUE", help="override one config key (repeatable), as for run")
    rep = sub.add_parser("replay", help="snapshot a replay storage, or restore one from a snapshot")
    rep_sub = rep.add_subparsers(dest="replay_command", required=True)
    snap = rep_sub.add_parser("snapshot", help="copy a storage's committed rows into a new snapshot directory "
                                               "(safe while workers write)")
    snap.add_argument("storage", help="the replay storage directory (the config's replay.path)")
    snap.add_argument("dest", help="the snapshot directory to create (must not exist)")
    restore = rep_sub.add_parser("restore", help="create a new storage from a snapshot")
    restore.add_argument("snapshot", help="a snapshot directory")
    restore.add_argument("dest", help="the storage directory to create (must not exist)")
    return parser


def _missing(path) -> bool:
    """Nothing at ``path`` (or a link to nothing); a path this process may not look at is not
    missing (EX_IOERR)."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        pass
    return False


def _replay(args) -> int:
    """``ingestd replay snapshot|restore``: one line on success; on failure the reason and a
    sysexits status: 66 no such source, 65 a source that is not a usable storage or snapshot,
    73 a destination that exists, 74 any other I/O error (no room, no access)."""
    from ingestd.errors import (BadSnapshot, CorruptStorage, IngestdError, SchemaMismatch, SnapshotExists,
                                StorageNotFound)
    from ingestd.replay import snapshot

    source = args.storage if args.replay_command == "snapshot" else args.snapshot
    try:
        if args.replay_command == "snapshot":
            info = snapshot.save(args.storage, args.dest)
        else:
            info = snapshot.restore(args.snapshot, args.dest)
    except (IngestdError, OSError) as exc:
        print(f"ingestd: replay {args.replay_command} failed: {exc}", file=sys.stderr)
        if isinstance(exc, SnapshotExists):
            return EX_CANTCREAT
        if _missing(source):
            return EX_NOINPUT
        if isinstance(exc, (BadSnapshot, CorruptStorage, SchemaMismatch, StorageNotFound)):
            return EX_DATAERR
        return EX_IOERR
    done = "snapshot written to" if args.replay_command == "snapshot" else "storage restored at"
    print(f"{done} {info.path}: {info.rows} rows (capacity {info.capacity}, write_count {info.write_count}"
          f"{f', {info.skipped} being written left out' if info.skipped else ''}), "
          f"snapshot {info.bytes / 1e6:.1f} MB, {info.seconds:.2f} s")
    return 0


def entry() -> int:
    """The ``ingestd`` program: for ``run``, first the exec that gives large copies their
    setting (``ingestd.service.tunables``), then :func:`main`. ``main`` itself never execs
    (the tests' fork server calls it in a fork of its own process)."""
    if sys.argv[1:2] != ["run"]:
        return main()
    from ingestd.service.tunables import exec_with_copy_tunable

    exec_with_copy_tunable()
    exit_now(main())


def exit_now(code: int) -> NoReturn:
    """End a daemon that has shut down (workers stopped, sockets and storage closed, locks only
    fds): flush what it wrote and leave without the interpreter's teardown, which frees torch's
    objects one by one for 0.8-0.9 s here and would push the exit past ``stop_timeout_s``. The
    ``atexit`` handlers run (the logging's flush among them, and any a plugin registered); all
    the daemon's threads are daemon threads, which that teardown would abandon too."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with that fd closed
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or vanished stream: nothing more can reach it
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the daemon's own handlers are in place (torch's import)
        return 128 + 2


def _config_check(args, cfg) -> int:
    """``ingestd config check FILE``: what ``run`` checks first, and the replay it would make."""
    from ingestd.service.probe import check_buildable, replay_room

    checked = cfg.load_config(args.file, args.overrides)
    paths = cfg.resolve_paths(checked, os.environ)
    rows, _ = check_buildable(checked, paths)
    print(f"{args.file}: ok; {replay_room(checked, paths, rows)}")
    return 0


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        from ingestd.service.signals import catch_early_sighup

        catch_early_sighup()  # before the seconds of imports: a SIGHUP must not kill a starting daemon
    if args.command == "replay":
        return _replay(args)
    from ingestd.errors import ConfigError, DaemonAlreadyRunning, LockBusy, SchemaMismatch, StorageFull
    from ingestd.service import config as cfg

    try:
        if args.command == "config" and args.config_command == "default":
            sys.stdout.write(cfg.DEFAULT_TOML)
            return 0
        if args.command == "config" and args.config_command == "reference":
            sys.stdout.write(config_reference_markdown())
            return 0
        if args.command == "config":
            return _config_check(args, cfg)
        config = cfg.load_config(args.config, args.overrides)
    except ConfigError as exc:
        from ingestd.service.journal import marked

        for each in exc.errors:  # (logging is not set up yet: under systemd, stored at priority err)
            print(marked(f"ingestd: config error: {each}", logging.ERROR, sys.stderr), file=sys.stderr)
        return EX_CONFIG
    _setup_logging(config.service.log_level)
    try:
        # the paths and the instance locks before torch's import: an unusable directory or a
        # second daemon is refused in a fraction of a second, not after seconds of start-up
        from ingestd.service.instance import claim_instance
        from ingestd.service.limits import raise_fd_limit

        raise_fd_limit()  # control connections count too: at the limit libzmq aborts the daemon

        claim = claim_instance(cfg.resolve_paths(config, os.environ))
        if config.metrics.enabled:
            from ingestd.metrics.exporter import check_bindable

            check_bindable(config.metrics)
        from ingestd.service.daemon import Daemon
        from ingestd.service.services import default_services

        daemon = Daemon(config, args.config, tuple(args.overrides), dict(os.environ))  # resolves the paths
        daemon.claim = claim
        daemon.services.extend(default_services(config))
        return daemon.run()
    except (ConfigError, SchemaMismatch, StorageFull) as exc:
        logging.getLogger("ingestd").error("cannot start: %s", exc)
        return EX_CONFIG
    except (DaemonAlreadyRunning, LockBusy) as exc:  # another process holds what it needs: a retry may do
        logging.getLogger("ingestd").error("cannot start: %s", exc)
        return EX_TEMPFAIL


def config_reference_markdown() -> str:
    """Every config key with its default and meaning, generated from the dataclasses."""
    from itertools import groupby

    from ingestd.service.config import reference

    lines = ["# Config reference", "",
             "Generated by `ingestd config reference` from the config dataclasses; a test keeps it in sync.",
             "Keys marked *Reloadable* change on `ingestctl reload` / SIGHUP; the rest need a restart.",
             "Integers are TOML's (64-bit: -2**63 to 2**63 - 1) and tables and arrays nest at most 32 levels",
             "(`env_kwargs` included); anything past that is refused naming the key, exit 78."]
    for section, rows in groupby(reference(), key=lambda row: row[0].split(".", 1)[0]):
        lines += ["", f"## [{section}]", "", "| key | default | meaning |", "|---|---|---|"]
        for key, default, doc in rows:
            cell = doc.replace("|", "\\|")
            lines.append(f"| `{key}` | `{default}` | {cell} |")
    return "\n".join(lines) + "\n"


def _setup_logging(level: str) -> None:
    from ingestd.service.journal import formatter_for

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter_for(sys.stderr))  # priority-prefixed lines when stderr is the journal
    root = logging.getLogger("ingestd")
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False


if __name__ == "__main__":
    sys.exit(entry())
