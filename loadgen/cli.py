"""The `loadgen` command line: run, sweep, report, selfcheck.

Exit status: 0 done (whatever the SLO verdict), 1 the target could not be used,
2 bad input (flags, files, SLO strings); errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from loadgen import commands
from loadgen.client import TargetError
from loadgen.errors import UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loadgen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one load run against the target")
    _add_run_flags(run)
    _add_load_flags(run)
    sweep = sub.add_parser("sweep", help="find the highest rate that meets the SLOs")
    _add_run_flags(sweep)
    sweep.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default="poisson")
    sweep.add_argument("--burstiness", type=float, help="gamma shape (1 = Poisson)")
    sweep.add_argument("--start-rate", type=float, default=1.0, help="req/s of the first point")
    sweep.add_argument("--target-attainment", type=float, default=99.0,
                       help="percent of requests that must meet every SLO (default 99)")
    sweep.add_argument("--bisect-steps", type=int, default=3)
    sweep.add_argument("--max-steps", type=int, default=8, help="doublings/halvings at most")
    report = sub.add_parser("report", help="re-render tables and plots from a saved report")
    report.add_argument("report", help="report.json or sweep.json written by run or sweep")
    report.add_argument("--out", help="folder for the plots (default: the report's folder)")
    report.add_argument("--slo", help="judge the records against these SLOs instead")
    selfcheck = sub.add_parser("selfcheck", help="how fast can this client send?")
    _add_workload_flags(selfcheck)
    return parser


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                        help="specpage's gRPC Generate (default), or an OpenAI-compatible "
                             "HTTP server's streamed /v1/completions and /v1/chat/completions")
    target.add_argument("--target", help="grpc: HOST:PORT (default 127.0.0.1:50051); "
                                         "openai: the base URL, http://HOST:PORT")
    target.add_argument("--model", help="openai: the model to ask for (default: the first "
                                        "that GET /v1/models lists)")
    target.add_argument("--tls", action="store_true",
                        help="grpc: TLS with the system's roots (openai: an https:// URL)")
    target.add_argument("--tls-ca", help="PEM file of roots to trust (grpc: implies --tls)")
    target.add_argument("--token", help="bearer token, sent as `authorization: Bearer ...`")
    target.add_argument("--token-file", help="file holding the bearer token")
    target.add_argument("--health-timeout", default="30s",
                        help="wait this long for health SERVING (openai: GET /health 200); "
                             "0 skips the check")
    bounds = parser.add_argument_group("bounds")
    bounds.add_argument("--requests", type=int, help="measured requests per run")
    bounds.add_argument("--duration", help="length of the measured schedule (e.g. 60s)")
    bounds.add_argument("--warmup", type=int, default=0, help="first N requests not measured")
    _add_workload_flags(parser)
    policy = parser.add_argument_group("server-side state and sampling")
    policy.add_argument("--share-prefix-cache", action="store_true",
                        help="reuse the prefix cache earlier runs left (default: every run, "
                             "and every sweep point, gets a fresh cache_salt and starts cold)")
    policy.add_argument("--request-seeds", action="store_true",
                        help="send each request's --seed-derived sampling seed (default: none, "
                             "as clients send; --seed always fixes prompts, lengths, arrivals)")
    measure = parser.add_argument_group("measurement and output")
    measure.add_argument("--slo", help="e.g. ttft=2000ms,tpot=200ms,e2e=10s")
    measure.add_argument("--max-inflight", type=int, default=1024,
                         help="client cap on open requests; waiting for it counts as latency")
    measure.add_argument("--request-timeout", default="300s",
                         help="a request's deadline, from sending to the stream's end")
    measure.add_argument("--out", default="loadgen-results", help="folder for results")
    measure.add_argument("--no-progress", action="store_true", help="no live display")
    measure.add_argument("--no-selfcheck", action="store_true", help="skip the client self-check")
    measure.add_argument("--no-plots", action="store_true", help="JSON and CSV only")


def _add_load_flags(parser: argparse.ArgumentParser) -> None:
    load = parser.add_argument_group("arrivals (open loop unless --concurrency)")
    load.add_argument("--rate", type=float, help="mean arrivals per second")
    load.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default="poisson")
    load.add_argument("--burstiness", type=float, help="gamma shape (1 = Poisson, <1 burstier)")
    load.add_argument("--concurrency", type=int, help="closed loop with N requests in flight")
    load.add_argument("--trace", help="JSONL trace to replay (offset_s, prompt, output_len, ...)")


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload")
    work.add_argument("--prompt-len", default="32",
                      help="N, fixed:N, uniform:LO,HI, normal:MEAN,STD, lognormal:MEAN,SIGMA")
    work.add_argument("--output-len", default="32", help="as --prompt-len; sets max_tokens")
    work.add_argument("--vocab-size", type=int, default=32000, help="token ids drawn below this")
    work.add_argument("--prompts-file", help="text prompts: word windows from this file")
    work.add_argument("--requests-file",
                      help="real requests: JSONL of {messages|prompt, max_tokens?} or "
                           "ShareGPT JSON, taken in seeded shuffled passes")
    work.add_argument("--chat", action="store_true", help="text prompts use the chat template")
    work.add_argument("--prefix-fraction", type=float, default=0.0,
                      help="fraction of requests that start with a shared prefix")
    work.add_argument("--num-prefixes", type=int, default=4)
    work.add_argument("--prefix-len", type=int, default=64)
    work.add_argument("--cancel-fraction", type=float, default=0.0,
                      help="fraction of requests cancelled after a random delay")
    work.add_argument("--cancel-max-delay", default="1s",
                      help="cancel delays are uniform in [0, D]")
    work.add_argument("--temperature", type=float, help="default: the server's")
    work.add_argument("--spec", choices=("on", "off", "auto"), default="auto",
                      help="speculation mode sent with each request")
    work.add_argument("--no-ignore-eos", action="store_true",
                      help="let EOS end outputs early (default: exactly --output-len tokens)")
    work.add_argument("--seed", type=int, default=0,
                      help="seeds the workload: prompts, lengths, arrivals, cancellations")


COMMANDS = {
    "run": commands.run,
    "sweep": commands.sweep,
    "report": commands.report,
    "selfcheck": commands.selfcheck,
}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse has printed its message; return, don't exit
        return int(exit_.code or 0)
    try:
        return asyncio.run(COMMANDS[args.command](args))
    except UsageError as error:
        print(f"loadgen {args.command}: error: {error}", file=sys.stderr)
        return 2
    except TargetError as error:
        print(f"loadgen {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"loadgen {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
