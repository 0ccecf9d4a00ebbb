"""`specpage config`: check the effective configuration, and print it as TOML."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specpage.config import dump_toml, load_config, parse_override


def add_parser(sub: Any, name: str) -> None:
    parser = sub.add_parser(
        name,
        help="check the effective config (file < SPECPAGE_* env < --set); --print shows it",
        description=__doc__,
    )
    parser.add_argument("--config", type=Path, help="TOML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key, e.g. server.port=6000 (repeatable; empty value: none)",
    )
    parser.add_argument("--print", action="store_true", help="print the effective config")
    parser.add_argument(
        "--show-secrets", action="store_true", help="print bearer_token instead of hiding it"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    overrides = dict(parse_override(text) for text in args.overrides)
    config = load_config(args.config, overrides=overrides)  # raises ConfigError, a ValueError
    if args.print:
        print(dump_toml(config, show_secrets=args.show_secrets), end="")
    return 0
