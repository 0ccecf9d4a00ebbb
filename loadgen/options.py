"""Command-line values into validated settings; every bad value becomes a UsageError."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.backend import RequestOptions, TargetOptions
from loadgen.errors import UsageError
from loadgen.lengths import parse_lengths
from loadgen.prompts import PromptSource, SharedPrefixes, TokenPrompts, read_text_prompts
from loadgen.request_file import read_request_file
from loadgen.schedule import Bounds
from loadgen.slo import Slo, parse_slo
from loadgen.trace import TraceEntry, read_trace
from loadgen.units import parse_seconds
from loadgen.workload import CancelPolicy, Workload

SECRET_FLAGS = ("token",)  # never written to a report
DEFAULT_GRPC_TARGET = "127.0.0.1:50051"
URL_SCHEMES = ("http://", "https://")


@dataclass(frozen=True)
class LoadShape:
    arrival: str  # poisson | gamma | constant (open loop without a trace)
    rate: float | None
    burstiness: float
    concurrency: int | None  # set: closed loop
    trace: list[TraceEntry] | None


@dataclass(frozen=True)
class RunSettings:
    target: TargetOptions
    request: RequestOptions
    workload: Workload
    load: LoadShape
    bounds: Bounds
    slo: Slo | None
    max_inflight: int
    health_timeout_s: float
    out: Path
    config: dict[str, Any]  # the flags as given, minus secrets, for the report


def run_settings(args: argparse.Namespace, sweeping: bool = False) -> RunSettings:
    load = _load_shape(args, sweeping)
    requests = _at_least(args.requests, 1, "--requests")
    duration_s = _duration(args.duration, "--duration")
    warmup = _at_least(args.warmup, 0, "--warmup") or 0
    if requests is None and duration_s is None:
        if load.trace is None:
            raise UsageError("give --requests N or --duration D to bound the run")
        requests = max(1, len(load.trace) - warmup)  # the whole trace
    bounds = Bounds(requests, duration_s, warmup)
    target = target_options(args)
    work = workload(args)
    if work.requests is not None and load.trace is not None:
        raise UsageError("--trace brings its own prompts and lengths: drop --requests-file")
    if work.requests is not None and target.api == "grpc":
        work.requests.check_grpc()
    return RunSettings(
        target=target,
        request=RequestOptions(
            temperature=_temperature(args.temperature), spec=args.spec, chat=args.chat,
            ignore_eos=not args.no_ignore_eos, request_seeds=args.request_seeds,
            share_prefix_cache=args.share_prefix_cache,
        ).for_new_run(),
        workload=work,
        load=load,
        bounds=bounds,
        slo=parse_slo(args.slo) if args.slo is not None else None,
        max_inflight=_at_least(args.max_inflight, 1, "--max-inflight") or 1,
        health_timeout_s=_non_negative_seconds(args.health_timeout, "--health-timeout"),
        out=output_folder(args.out),
        config={k: v for k, v in vars(args).items() if k not in SECRET_FLAGS},
    )


def output_folder(text: str) -> Path:
    """Checked now (created when results are written): a run that cannot save should not start."""
    path = Path(text)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise UsageError(f"--out: cannot create {text}: {existing} is not a writable folder")
    return path


def target_options(args: argparse.Namespace) -> TargetOptions:
    if args.token is not None and args.token_file is not None:
        raise UsageError("give --token or --token-file, not both")
    token = args.token
    if args.token_file is not None:
        token = _read(args.token_file, "--token-file").decode("utf-8", "replace").strip()
        if not token:
            raise UsageError(f"--token-file: {args.token_file} is empty")
    ca = _read(args.tls_ca, "--tls-ca") if args.tls_ca is not None else None
    timeout = _duration(args.request_timeout, "--request-timeout")
    assert timeout is not None
    if args.api == "openai":
        return _openai_target(args, ca, token, timeout)
    if args.model is not None:
        raise UsageError("--model names the model of an OpenAI-compatible server: "
                         "add --api openai (the gRPC daemon serves the model it loaded)")
    address = args.target or DEFAULT_GRPC_TARGET
    if ":" not in address or address.startswith(URL_SCHEMES):
        raise UsageError(f"--target must be HOST:PORT, got {address!r}"
                         + (" (a URL is for --api openai)" if "//" in address else ""))
    return TargetOptions(address, args.tls or ca is not None, ca, token, timeout)


def _openai_target(
    args: argparse.Namespace, ca: bytes | None, token: str | None, timeout: float
) -> TargetOptions:
    url = args.target
    if url is None or not url.startswith(URL_SCHEMES):
        raise UsageError(f"--api openai needs --target http://HOST:PORT (or https://), "
                         f"got {url!r}")
    tls = url.startswith("https://")
    if (args.tls or ca is not None) and not tls:
        raise UsageError(f"--tls and --tls-ca need an https:// --target, got {url!r}")
    if args.spec != "auto":
        raise UsageError("--spec on|off is a field of specpage's gRPC request; "
                         "the OpenAI API has none: drop it or use --api grpc")
    return TargetOptions(url.rstrip("/"), tls, ca, token, timeout, api="openai",
                         model=args.model or None)


def workload(args: argparse.Namespace) -> Workload:
    """The request-content half of the flags (shared by run, sweep and selfcheck)."""
    source: PromptSource
    if args.prompts_file is not None and args.requests_file is not None:
        raise UsageError("--prompts-file (word windows) and --requests-file (whole requests) "
                         "are both prompt sources: give one")
    if args.prompts_file is not None:
        source = read_text_prompts(args.prompts_file)
    else:
        source = TokenPrompts(_at_least(args.vocab_size, 1, "--vocab-size") or 1)
    if args.chat and args.prompts_file is None and args.requests_file is None:
        raise UsageError("--chat wraps text prompts: it needs --prompts-file or --requests-file")
    prefixes = None
    fraction = _fraction(args.prefix_fraction, "--prefix-fraction")
    if fraction > 0 and args.requests_file is not None:
        raise UsageError("--prefix-fraction prepends prefixes to generated prompts; "
                         "--requests-file sends its requests as they are: drop one")
    if fraction > 0:
        count = _at_least(args.num_prefixes, 1, "--num-prefixes") or 1
        length = _at_least(args.prefix_len, 1, "--prefix-len") or 1
        prefixes = SharedPrefixes.build(source, args.seed, (fraction, count, length))
    cancel = None
    cancel_fraction = _fraction(args.cancel_fraction, "--cancel-fraction")
    if cancel_fraction > 0:
        delay = _non_negative_seconds(args.cancel_max_delay, "--cancel-max-delay")
        cancel = CancelPolicy(cancel_fraction, delay)
    return Workload(
        source=source,
        prompt_len=parse_lengths(args.prompt_len, "--prompt-len"),
        output_len=parse_lengths(args.output_len, "--output-len"),
        seed=args.seed,
        prefixes=prefixes,
        cancel=cancel,
        requests=read_request_file(args.requests_file) if args.requests_file else None,
    )


def _load_shape(args: argparse.Namespace, sweeping: bool) -> LoadShape:
    rate = None if sweeping else args.rate
    concurrency = None if sweeping else args.concurrency
    trace_path = None if sweeping else args.trace
    if rate is not None and (not math.isfinite(rate) or rate <= 0):
        raise UsageError(f"--rate must be a finite number > 0, got {rate:g}")
    if concurrency is not None and concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {concurrency}")
    if sum(x is not None for x in (rate, concurrency)) > 1:
        raise UsageError("--rate (open loop) and --concurrency (closed loop) exclude each other")
    if trace_path is not None and rate is not None:
        raise UsageError("--trace brings its own arrival times; drop --rate")
    if not sweeping and rate is None and concurrency is None and trace_path is None:
        raise UsageError("give --rate R (open loop), --concurrency N (closed loop) or --trace FILE")
    burstiness = 1.0 if args.burstiness is None else args.burstiness
    if args.burstiness is not None and args.arrival != "gamma":
        raise UsageError("--burstiness shapes gamma arrivals: add --arrival gamma")
    if not math.isfinite(burstiness) or burstiness <= 0:
        raise UsageError(f"--burstiness must be > 0, got {burstiness:g}")
    trace = read_trace(trace_path) if trace_path is not None else None
    return LoadShape(args.arrival, rate, burstiness, concurrency, trace)


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise UsageError(f"{flag}: cannot read {path}: {error.strerror or error}") from None


def _at_least(value: int | None, low: int, flag: str) -> int | None:
    if value is not None and value < low:
        raise UsageError(f"{flag} must be >= {low}, got {value}")
    return value


def _fraction(value: float, flag: str) -> float:
    if not 0.0 <= value <= 1.0:
        raise UsageError(f"{flag} must be within 0..1, got {value:g}")
    return value


def _temperature(value: float | None) -> float | None:
    if value is not None and (not math.isfinite(value) or value < 0):
        raise UsageError(f"--temperature must be >= 0, got {value:g}")
    return value


def _duration(text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    seconds = parse_seconds(text, flag)
    if seconds <= 0:
        raise UsageError(f"{flag} must be > 0, got {text!r}")
    return seconds


def _non_negative_seconds(text: str, flag: str) -> float:
    seconds = parse_seconds(text, flag)
    if seconds < 0:
        raise UsageError(f"{flag} must be >= 0, got {text!r}")
    return seconds

