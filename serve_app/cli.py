"""`tidal` subcommands owned by serve_app: bench."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from serve_app.bench import register as register_bench

    register_bench(sub)
