"""``ingestd``: run the daemon, print or check its config."""
from __future__ import annotations

import argparse
import logging
import os
import sys

EX_CONFIG = 78  # sysexits.h: configuration error


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ingestd", description="Experience-ingestion daemon for RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the daemon in the foreground (logs to stderr)")
    run.add_argument("--config", "-c", metavar="FILE", help="TOML config file (default: the embedded default)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config key (repeatable), e.g. --set workers.count=4")
    cfg = sub.add_parser("config", help="print the default config, or check a config file")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    cfg_sub.add_parser("default", help="print the embedded default config (TOML)")
    check = cfg_sub.add_parser("check", help="validate a config file; exit 78 if it is wrong")
    check.add_argument("file")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ingestd.errors import ConfigError, SchemaMismatch
    from ingestd.service import config as cfg

    try:
        if args.command == "config" and args.config_command == "default":
            sys.stdout.write(cfg.DEFAULT_TOML)
            return 0
        if args.command == "config":
            cfg.load_config(args.file, args.overrides)
            print(f"{args.file}: ok")
            return 0
        config = cfg.load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"ingestd: config error: {exc}", file=sys.stderr)
        return EX_CONFIG
    _setup_logging(config.service.log_level)
    from ingestd.service.daemon import Daemon
    from ingestd.service.services import default_services

    daemon = Daemon(config, args.config, tuple(args.overrides), dict(os.environ))
    daemon.services.extend(default_services(config))
    try:
        return daemon.run()
    except (ConfigError, SchemaMismatch) as exc:
        logging.getLogger("ingestd").error("cannot start: %s", exc)
        return EX_CONFIG


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("ingestd")
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False


if __name__ == "__main__":
    sys.exit(main())
