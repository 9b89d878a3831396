"""`flashlane` command line: one module per subcommand, each with add_parser() and run()."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .help import HelpFormatter, unknown_arguments_error

COMMANDS = {
    "generate": "flashlane.cli.generate",
    "serve": "flashlane.cli.serve",
    "bench": "flashlane.cli.bench",
    "compare": "flashlane.cli.compare",
    "analyze": "flashlane.cli.analyze",
    "profile": "flashlane.cli.profile",
    "calibrate": "flashlane.cli.calibrate",
    "simulate": "flashlane.cli.simulate",
    "tune": "flashlane.cli.tune",
    "history": "flashlane.cli.history",
    "make-tiny": "flashlane.cli.make_tiny",
    "eval": "flashlane.cli.eval",
    "prune": "flashlane.cli.prune",
    "distill": "flashlane.cli.distill",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """``only``: import just that command's module (so `flashlane analyze` never loads torch)."""
    parser = argparse.ArgumentParser(
        prog="flashlane", formatter_class=HelpFormatter,
        description="Serve, benchmark, explain and compare hybrid sparse/linear-attention MoE models.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(command if command in COMMANDS else None)
    args, extras = parser.parse_known_args(argv)
    if extras:  # a misspelt flag: the subcommand's usage, not the top-level one
        unknown_arguments_error(getattr(args, "_parser", parser), extras)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"flashlane {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
