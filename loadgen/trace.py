"""Trace replay input: one JSON object per line.

    {"offset_s": 0.25, "prompt_len": 128, "output_len": 64}
    {"offset_s": 0.40, "prompt": "Tell me a story", "output_len": 32,
     "sampling": {"temperature": 0.7, "top_p": 0.9}}
    {"offset_s": 0.41, "prompt_token_ids": [12, 7, 99], "output_len": 16}

offset_s is the arrival time from the start of the run; exactly one of prompt,
prompt_token_ids and prompt_len gives the prompt (prompt_len is filled from the
run's prompt source); sampling is optional. Unknown keys are errors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from loadgen.errors import UsageError

PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_len")
# Sampling keys a trace may set, with the JSON types each accepts.
SAMPLING_KEYS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "seed": (int,),
    "stop": (list,),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
}
KNOWN_KEYS = frozenset({"offset_s", "output_len", "sampling", *PROMPT_KEYS})


@dataclass(frozen=True)
class TraceEntry:
    offset_s: float
    output_len: int
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_len: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


def read_trace(path: str) -> list[TraceEntry]:
    """Entries sorted by offset (stable, so equal offsets keep file order)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--trace: cannot read {path}: {error}") from None
    entries = [
        _entry(line, f"{path}:{number}")
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    if not entries:
        raise UsageError(f"--trace: {path} holds no requests")
    return sorted(entries, key=lambda entry: entry.offset_s)


def _entry(line: str, where: str) -> TraceEntry:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise UsageError(f"--trace {where}: not JSON ({error.msg})") from None
    if not isinstance(item, dict):
        raise UsageError(f"--trace {where}: each line must be a JSON object")
    unknown = sorted(set(item) - KNOWN_KEYS)
    if unknown:
        raise UsageError(f"--trace {where}: unknown key(s) {', '.join(unknown)}")
    offset = item.get("offset_s")
    if not _is_number(offset) or not math.isfinite(offset) or offset < 0:
        raise UsageError(f"--trace {where}: offset_s must be a number >= 0")
    prompts = [key for key in PROMPT_KEYS if key in item]
    if len(prompts) != 1:
        raise UsageError(f"--trace {where}: give exactly one of {', '.join(PROMPT_KEYS)}")
    return TraceEntry(
        offset_s=float(offset),
        output_len=_positive_int(item.get("output_len"), "output_len", where),
        prompt_text=_prompt_text(item, where),
        prompt_token_ids=_token_ids(item, where),
        prompt_len=_positive_int(item["prompt_len"], "prompt_len", where)
        if "prompt_len" in item
        else None,
        sampling=_sampling(item.get("sampling", {}), where),
    )


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_int(value: Any, key: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"--trace {where}: {key} must be an integer >= 1")
    return value


def _prompt_text(item: dict[str, Any], where: str) -> str | None:
    if "prompt" not in item:
        return None
    if not isinstance(item["prompt"], str) or not item["prompt"]:
        raise UsageError(f"--trace {where}: prompt must be a non-empty string")
    return str(item["prompt"])


def _token_ids(item: dict[str, Any], where: str) -> tuple[int, ...] | None:
    if "prompt_token_ids" not in item:
        return None
    ids = item["prompt_token_ids"]
    valid = isinstance(ids, list) and ids and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    )
    if not valid:
        raise UsageError(f"--trace {where}: prompt_token_ids must be a non-empty list of ids >= 0")
    return tuple(ids)


def _sampling(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UsageError(f"--trace {where}: sampling must be a JSON object")
    for key, setting in value.items():
        if key not in SAMPLING_KEYS:
            known = ", ".join(SAMPLING_KEYS)
            raise UsageError(f"--trace {where}: unknown sampling key {key!r}; known: {known}")
        if not isinstance(setting, SAMPLING_KEYS[key]) or (
            isinstance(setting, bool) and key != "ignore_eos"
        ):
            raise UsageError(f"--trace {where}: sampling.{key} has the wrong type")
    return dict(value)
