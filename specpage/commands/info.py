"""`specpage info --server HOST:PORT`: a running daemon's models, pool
counters, current k and acceptance, as JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

INT64_TYPES = frozenset({
    FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64,
})


def add_parser(sub: Any, name: str) -> None:
    parser = sub.add_parser(name, help="a running daemon's state", description=__doc__)
    parser.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the daemon")
    parser.add_argument("--token", help="bearer token")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(json.dumps(asyncio.run(server_info(args.server, args.token)), indent=2))
    return 0


async def server_info(server: str, token: str | None) -> dict[str, Any]:
    from specpage.client import Client

    async with Client(server, token=token) as client:
        info = await client.server_info()
    return message_dict(info)


def message_dict(message: Message) -> dict[str, Any]:
    """Every field by its proto name, 64-bit integers as JSON numbers.

    protobuf's JSON mapping writes them as strings (JavaScript's numbers are
    doubles); Python's json has no such limit, and a counter read as "17"
    does not compare with 17.
    """
    from google.protobuf.json_format import MessageToDict

    data = MessageToDict(message, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)
    return _numbers(message.DESCRIPTOR, data)


def _numbers(descriptor: Descriptor, data: dict[str, Any]) -> dict[str, Any]:
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            if field.is_repeated:
                data[field.name] = [_numbers(field.message_type, item) for item in value]
            else:
                data[field.name] = _numbers(field.message_type, value)
        elif field.type in INT64_TYPES:
            data[field.name] = [int(v) for v in value] if field.is_repeated else int(value)
    return data
