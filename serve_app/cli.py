"""`tidal check-config`, the one subcommand owned by serve_app (`tidal bench` is loadgen.sim.bench's)."""

from __future__ import annotations

import argparse
import sys


def _check_config(args: argparse.Namespace) -> int:
    import yaml

    from serve_app.config_check import check_serve_config

    failed = False
    for path in args.files:
        with open(path) as f:
            errors = check_serve_config(yaml.safe_load(f))
        for err in errors:
            print(f"{path}: {err}", file=sys.stderr)
        failed |= bool(errors)
        if not errors:
            print(f"{path}: ok")
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("check-config", help="strictly validate Serve config files (unknown keys, bounds, args)")
    p.add_argument("files", nargs="+")
    p.set_defaults(func=_check_config)
