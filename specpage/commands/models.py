"""`specpage models`: fetch the models specpage runs into the local cache."""

from __future__ import annotations

import argparse
import time
from typing import Any

from specpage.models import fetch


def add_parser(sub: Any, name: str) -> None:
    parser = sub.add_parser(name, help="fetch or list models", description=__doc__)
    actions = parser.add_subparsers(dest="action", required=True)
    get = actions.add_parser(
        "fetch", help="download, verify (and convert, unless served as its GGUF) a model once "
        "(a packaged one: where it is)"
    )
    get.add_argument("name", help=f"one of: {', '.join(fetch.known_models())}")
    get.set_defaults(run=run_fetch)
    listing = actions.add_parser("list", help="known models and where they are cached")
    listing.set_defaults(run=run_list)


def run_fetch(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    folder = fetch.ensure_model(args.name)
    print(f"{args.name}: {folder} ({time.perf_counter() - start:.1f} s)")
    return 0


def run_list(args: argparse.Namespace) -> int:
    for name in fetch.known_models():
        if name in fetch.PACKAGED:
            try:
                print(f"{name}\tpackaged\t{fetch.packaged_model(name)}")
            except fetch.MissingPackagedModelError:
                print(f"{name}\tmissing from the package\t-")
            continue
        if name in fetch.SERVED_AS_GGUF:
            path = fetch.cache_dir() / "gguf" / fetch.SERVED_AS_GGUF[name]
            print(f"{name}\t{'cached' if path.is_file() else 'not fetched'}\t{path}")
            continue
        folder = fetch.cache_dir() / "models" / name
        state = "cached" if fetch.is_converted(folder) else "not fetched"
        print(f"{name}\t{state}\t{folder}")
    return 0
