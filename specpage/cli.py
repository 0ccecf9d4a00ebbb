"""The `specpage` command line: one subcommand per module in specpage.commands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc

from specpage import __version__
from specpage.commands import chat, config, generate, info, kv_plan, models, serve
from specpage.models.config import ModelLoadError

COMMANDS = {
    "chat": chat, "config": config, "generate": generate, "info": info, "kv-plan": kv_plan,
    "models": models, "serve": serve,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpage", description=__doc__)
    parser.add_argument("--version", action="version", version=f"specpage {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_parser(sub, name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, ModelLoadError) as error:
        print(f"specpage {args.command}: error: {error}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as error:
        print(f"specpage {args.command}: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
