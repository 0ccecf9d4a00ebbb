"""`specpage info --server HOST:PORT`: a running daemon's models, pool
counters, current k and acceptance, as JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any


def add_parser(sub: Any, name: str) -> None:
    parser = sub.add_parser(name, help="a running daemon's state", description=__doc__)
    parser.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the daemon")
    parser.add_argument("--token", help="bearer token")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(json.dumps(asyncio.run(server_info(args.server, args.token)), indent=2))
    return 0


async def server_info(server: str, token: str | None) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    from specpage.client import Client

    async with Client(server, token=token) as client:
        info = await client.server_info()
    return MessageToDict(info, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)
