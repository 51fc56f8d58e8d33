"""The worker's command line: ``python -m studio.train CONFIG [--run-dir DIR] | --resume DIR``.

``studio train`` is the same command: the top-level CLI gives its ``train``
subcommand these arguments and calls ``train``. Importing this module loads no
ML library; ``train`` does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from studio.core.errors import StudioError
from studio.core.run.commands import run_handler

PROG = "studio train"
HELP = "train from a YAML config (or resume a run)"
DESCRIPTION = ("Train from a YAML run config. Events go to RUN_DIR/events.jsonl. "
               "Stop cleanly with Ctrl+C, a 'stop' line on stdin, or a STOP file in the run directory.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", type=Path, help="the run config (YAML)")
    parser.add_argument("--run-dir", type=Path, help="where the run goes (default: a new folder under the user data directory)")
    parser.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run from its newest complete checkpoint")


def train(args: argparse.Namespace) -> int:
    from studio.core.config import load_config
    from studio.train.worker import run

    if args.resume:
        code, _ = run(None, args.resume, resume=True)
        return code
    if args.config is None:
        raise StudioError("no config given", "run `studio train CONFIG.yaml`, or `studio config init my.yaml` to write one", kind="usage")
    # validated by the run, with the file's YAML lines, before any run folder is made
    code, _ = run(load_config(args.config), args.run_dir, config_file=args.config)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_handler(train, build_parser().parse_args(argv))
