"""`specpage kv-plan`: the KV memory arithmetic for given lengths and models."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import msgspec

from specpage.core import kv_layout
from specpage.core.kv_layout import KvShape


def add_parser(sub: Any, name: str) -> None:
    parser = sub.add_parser(
        name,
        help="KV memory arithmetic: utilization, bytes per token, blocks per budget",
        description=__doc__,
    )
    parser.add_argument("--lengths", type=_ints, required=True, help="e.g. 37,91,128")
    parser.add_argument("--block-sizes", type=_ints, default=[16], help="e.g. 16,32")
    parser.add_argument("--reserve", type=int, help="max-length reservation per sequence")
    parser.add_argument("--target", help="target model: HF config.json or its folder")
    parser.add_argument("--draft", help="draft model: HF config.json or its folder")
    parser.add_argument("--layers", type=int, help="target layers (instead of --target)")
    parser.add_argument("--kv-heads", type=int, help="target KV heads")
    parser.add_argument("--head-dim", type=int, help="target head dim")
    parser.add_argument("--window", type=int, help="target's sliding window (with --layers)")
    parser.add_argument("--windowed-layers", type=int,
                        help="target layers that attend within --window (with --layers)")
    parser.add_argument("--dtype", help="KV dtype of both models (fp32, bf16, fp16, fp8); "
                        "default: the daemon's at its default model.dtype on --device")
    parser.add_argument("--device", default="cpu", help="the daemon's model.device (default cpu)")
    parser.add_argument("--budget", type=kv_layout.parse_bytes, help="KV bytes, e.g. 8GiB")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    if args.json:
        print(msgspec.json.encode(plan).decode())
    else:
        print(render(plan))
    return 0


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    plan: dict[str, Any] = {
        "lengths": args.lengths,
        "valid": sum(args.lengths),
        "paging": [kv_layout.paging(args.lengths, b) for b in args.block_sizes],
    }
    if args.reserve:
        plan["reservation"] = kv_layout.reservation(args.lengths, args.reserve)
    models = _models(args)
    if models:
        per_token = {name: shape.bytes_per_token for name, shape in models.items()}
        per_token["sum"] = sum(per_token.values())
        plan["models"] = models
        plan["kv_bytes_per_token"] = per_token
        windowed = {name: [kv_layout.windowed_tables(args.lengths, b, shape)
                           for b in args.block_sizes]
                    for name, shape in models.items() if shape.windowed_layers}
        if windowed:
            plan["windowed_tables"] = windowed
        if args.budget:
            plan["budget_bytes"] = args.budget
            plan["blocks_in_budget"] = {
                b: kv_layout.blocks_that_fit(args.budget, b, per_token["sum"])
                for b in args.block_sizes
            }
    return plan


def render(plan: dict[str, Any]) -> str:
    lines = [f"sequences: {len(plan['lengths'])}, valid positions: {plan['valid']}"]
    if "reservation" in plan:
        r = plan["reservation"]
        lines.append(
            f"reserve {r.max_length}: allocated {r.allocated}, waste {r.waste}, "
            f"utilization {r.utilization:.2%}"
        )
    for p in plan["paging"]:
        lines.append(
            f"paged, block {p.block_size}: allocated {p.allocated}, tail waste {p.tail_waste}, "
            f"utilization {p.utilization:.2%}, block tables {p.block_table_bytes} B"
        )
    for name, count in plan.get("kv_bytes_per_token", {}).items():
        lines.append(f"KV bytes per token, {name}: {count}")
    for name, tables in plan.get("windowed_tables", {}).items():
        shape = plan["models"][name]
        for t in tables:
            lines.append(
                f"{name}, block {t.block_size}: {shape.windowed_layers} of {shape.layers} layers "
                f"slide over {shape.window} positions; KV in one block table "
                f"{t.one_table_bytes} B, with a table of their own {t.windowed_table_bytes} B "
                f"({t.saving:.2%} less)"
            )
    for size, blocks in plan.get("blocks_in_budget", {}).items():
        lines.append(
            f"blocks of {size} in {plan['budget_bytes']} B: {blocks} ({blocks * size} positions)"
        )
    return "\n".join(lines)


def daemon_dtype(device: str) -> str:
    """The dtype the daemon loads both models in, and so keeps their KV in, at
    its default model.dtype ("auto": bf16 where the device computes it
    natively, else fp32): the loader's rule, not the checkpoint's torch_dtype."""
    import torch  # only here: the arithmetic alone needs no torch

    from specpage.config import ModelSection
    from specpage.models.loader import resolve_dtype

    dtype = resolve_dtype(ModelSection().dtype, torch.device(device))
    return str(dtype).removeprefix("torch.")


def _models(args: argparse.Namespace) -> dict[str, KvShape]:
    if not (args.target or args.draft or args.layers or args.kv_heads or args.head_dim):
        if args.budget:
            raise ValueError("--budget needs a model (--target or --layers/--kv-heads/--head-dim)")
        return {}
    dtype = args.dtype or daemon_dtype(args.device)  # one dtype for both, as the daemon
    models = {}
    if args.target:
        models["target"] = _with_windows(KvShape.from_hf_config(args.target, dtype), args.target)
    elif args.layers or args.kv_heads or args.head_dim:
        if not (args.layers and args.kv_heads and args.head_dim):
            raise ValueError("--layers, --kv-heads and --head-dim go together")
        if bool(args.window) != bool(args.windowed_layers):
            raise ValueError("--window and --windowed-layers go together")
        models["target"] = KvShape(args.layers, args.kv_heads, args.head_dim,
                                   kv_layout.dtype_bytes(dtype), args.windowed_layers or 0,
                                   args.window or 0)
    if args.draft:
        models["draft"] = _with_windows(KvShape.from_hf_config(args.draft, dtype), args.draft)
    return models


def _with_windows(shape: KvShape, config: str) -> KvShape:
    """shape with its sliding-window layers, as the loader reads the config
    (models/config.py: Gemma 3's layer types, Qwen's max_window_layers); a
    config the loader cannot read (an architecture it does not serve) has
    none."""
    from specpage.models.config import ModelConfig, ModelLoadError

    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    try:
        model = ModelConfig.from_dict(json.loads(path.read_text()), str(path))
    except (ModelLoadError, ValueError, AssertionError):
        return shape
    windowed = [i for i in range(model.num_layers) if model.window_of(i) is not None]
    if not windowed or model.sliding_window is None:
        return shape
    return msgspec.structs.replace(shape, windowed_layers=len(windowed),
                                   window=model.sliding_window)


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        message = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
