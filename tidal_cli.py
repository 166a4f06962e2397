"""The `tidal` command. Each package contributes subcommands through a `register` function."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "loadgen.sim.bench",         # bench
    "serve_app.cli",             # check-config
    "calibration.fit",           # fit-cost-model
    "actors.generate",           # generate
    "actors.profiler",           # profile
    "loadgen.cli",               # simulate, study, replay, compare
    "ops.cli",                   # k8s, dashboards
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description="tidalserve command-line tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
