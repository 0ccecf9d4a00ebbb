"""`specpage serve`: run the daemon (config file < SPECPAGE_* env < flags)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

import uvloop

from specpage.config import load_config, parse_override
from specpage.serve.logging_setup import configure_logging

# flag -> dotted config key
SHORTCUTS = {"host": "server.host", "port": "server.port", "http_port": "server.http_port",
             "target": "model.target",
             "draft": "model.draft", "spec_k": "engine.spec_k",
             "spec_methods": "engine.spec_methods", "spec_corpus": "engine.spec_corpus",
             "tensor_parallel_size": "engine.tensor_parallel_size",
             "deterministic": "engine.deterministic",
             "quantization": "model.quantization"}


def add_parser(sub: Any, name: str) -> None:
    parser = sub.add_parser(name, help="run the gRPC daemon", description=__doc__)
    parser.add_argument("--config", type=Path, help="TOML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one key (repeatable)")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", help="gRPC port (default 50051; 0: any free port)")
    parser.add_argument("--http-port", help="OpenAI-compatible HTTP API port (default off; "
                        "0: any free port)")
    parser.add_argument("--model", "--target", dest="target", metavar="MODEL",
                        help="target model: HF folder, .gguf or a known name")
    parser.add_argument("--draft", help="draft model (empty: no speculation)")
    parser.add_argument("--spec-k", help="largest k (0: no speculation)")
    parser.add_argument("--spec-methods", help="proposers that need no model, comma-separated: "
                        "ngram (prompt lookup), suffix (earlier requests of the same cache "
                        "salt), corpus (a fixed table of the target's own answers); empty: "
                        "none (default ngram,suffix,corpus)")
    parser.add_argument("--spec-corpus", help="the corpus proposer's table: auto (the one "
                        "that ships for the target's vocabulary, if any), a table file, or "
                        "empty for none (default auto)")
    parser.add_argument("--quantization", help="both models' linears: none, q4, q4-g64, "
                        "q4-g128 or auto (default: q4 where a model is a Q4_0/Q4_1 GGUF)")
    parser.add_argument("--deterministic", action="store_const", const="true", default=None,
                        help="a request's tokens the same bit for bit whatever else runs "
                        "(engine.deterministic; its cost: docs/BENCHMARKS.md)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the names the HTTP API serves the target as (default: its "
                        "model name and its Hugging Face id where known)")
    parser.add_argument("--tensor-parallel-size", help="ranks the target's forward is split "
                        "over (default 1; must divide its heads, KV heads and vocabulary)")
    parser.set_defaults(run=run)


def served_names(names: list[str]) -> str:
    """--served-model-name's names as server.served_model_name's one text."""
    bad = next((name for name in names if not name or "," in name), None)
    if bad is not None:  # the setting is comma-separated
        raise ValueError(f"--served-model-name: {bad!r}: a name is not empty and has no comma")
    return ",".join(names)


def run(args: argparse.Namespace) -> int:
    overrides: dict[str, object] = dict(parse_override(text) for text in args.overrides)
    for flag, key in SHORTCUTS.items():
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    if args.served_model_name is not None:
        overrides["server.served_model_name"] = served_names(args.served_model_name)
    config = load_config(args.config, overrides=overrides)
    configure_logging(config.server.log_level)
    from specpage.serve.daemon import (
        serve,  # imports torch and the models: after the config is good
    )

    logging.getLogger("specpage").info("starting", extra={"config": str(args.config or "")})
    try:
        return uvloop.run(serve(config)) if hasattr(uvloop, "run") else asyncio.run(serve(config))
    finally:
        # The loop's handlers (a second SIGTERM while draining does nothing)
        # went with it, back to the default that kills: the daemon has
        # drained and is exiting, so one more stop request changes nothing.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
