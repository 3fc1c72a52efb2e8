"""The ``hybridkv`` command line: replay, sweep, check-trace, verify.

Exit codes: 0 success; 2 bad input (one line on stderr, from a ``HybridKVError``);
1 anything else (a bug: its traceback is kept).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from hybridkv.errors import ConfigError, HybridKVError
from hybridkv.policies import CORE_POLICIES
from hybridkv.sim.admission import ORDERS
from hybridkv.sim.commands import (
    DEFAULT_MODEL,
    DEFAULT_WORKLOAD,
    cmd_check_trace,
    cmd_replay,
    cmd_sweep,
)
from hybridkv.sim.report import REPORT_HELP


def _add_source_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--trace", help="trace file or directory (Mooncake, WEKA, RAGPulse, native)")
    group.add_argument("--workload", help="synthetic workload: retention-microbench, agentic, "
                       f"aba, shared-prefix (default: {DEFAULT_WORKLOAD})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="workload parameter (repeatable), e.g. --set num_sessions=8")
    parser.add_argument("--model", default=None,
                        help=f"preset name or a .toml path (default: {DEFAULT_MODEL})")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--max-running", type=int, default=None,
                        help="concurrent requests (default 16, or the workload's own)")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="token budget per step (default 8192)")
    parser.add_argument("--hash-algo", choices=("sha256", "xxhash"), default="sha256")
    parser.add_argument("--eagle", action="store_true", help="EAGLE/MTP (lookahead block hashes)")
    parser.add_argument("--admission", default="fcfs",
                        help="admission order(s), comma-separated or 'all': "
                        f"{', '.join(ORDERS)} (default fcfs: the protocol)")


def _add_pool_arguments(parser: argparse.ArgumentParser, *, many: bool) -> None:
    pool = parser.add_mutually_exclusive_group()
    if many:
        pool.add_argument("--num-blocks", help="comma-separated pool sizes in blocks")
        pool.add_argument("--kv-memory", help="comma-separated KV memory sizes, e.g. 8GiB,16GiB")
    else:
        pool.add_argument("--num-blocks", type=int, help="pool size in blocks (null included)")
        pool.add_argument("--kv-memory", help="KV memory, e.g. 40GiB (converted to blocks)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridkv", description="Prefix-cache replay and verification for hybrid models")
    sub = parser.add_subparsers(dest="command", required=True)

    replay = sub.add_parser("replay", help="replay a trace or workload under retention policies",
                            description=REPORT_HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_source_arguments(replay)
    _add_pool_arguments(replay, many=False)
    replay.add_argument("--policy", default="core",
                        help="comma-separated policies, or 'core' (default): "
                        + ",".join(CORE_POLICIES))
    replay.add_argument("--json", type=Path, help="write the report as JSON")
    replay.add_argument("--plot", type=Path, help="write a PNG plot")
    replay.add_argument("--paranoid", action="store_true",
                        help="check every invariant after every step (slow)")
    replay.add_argument("--quiet", action="store_true", help="no progress bar")
    replay.add_argument("--jobs", type=int, default=1,
                        help="replay policies in this many processes (default 1)")

    sweep = sub.add_parser("sweep", help="pool sizes × policies → CSV and PNG")
    _add_source_arguments(sweep)
    _add_pool_arguments(sweep, many=True)
    sweep.add_argument("--policy", default="core")
    sweep.add_argument("--csv", type=Path, default=Path("sweep.csv"))
    sweep.add_argument("--plot", type=Path, default=Path("sweep.png"))
    sweep.add_argument("--quiet", action="store_true")

    check = sub.add_parser("check-trace", help="validate a trace and print its statistics")
    check.add_argument("path")
    check.add_argument("--model", default=None)
    check.add_argument("--limit", type=int, default=None)

    _add_verify_parser(sub)
    return parser


def _add_verify_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verify = sub.add_parser("verify", help="prove cache hits exact on the reference engine")
    try:
        from hybridkv.engine.verify import add_verify_arguments
    except ImportError:  # torch missing: the command explains itself when run
        verify.set_defaults(engine_missing=True)
        return
    add_verify_arguments(verify)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:  # pipes and files: wide enough that tables never wrap
        console = Console(width=160)
    err_console = Console(stderr=True)
    commands: dict[str, Callable[[argparse.Namespace, Console, Console], int]] = {
        "replay": cmd_replay, "sweep": cmd_sweep, "check-trace": cmd_check_trace,
        "verify": _cmd_verify,
    }
    try:
        return commands[args.command](args, console, err_console)
    except HybridKVError as err:
        print(f"hybridkv {args.command}: error: {err}", file=sys.stderr)
        return 2


def _cmd_verify(args: argparse.Namespace, console: Console, err_console: Console) -> int:
    if getattr(args, "engine_missing", False):
        raise ConfigError("verify", "torch",
                          "install the engine extra: pip install 'hybridkv[engine]'")
    from hybridkv.engine.verify import cmd_verify

    return int(cmd_verify(args))


__all__ = ["build_parser", "main"]
