"""The ``hybridkv`` command line: replay, sweep, check-trace, verify, cluster.

Exit codes: 0 success; 1 ``verify`` found a divergence, or a bug (its traceback is kept);
2 bad input: a ``HybridKVError`` or a bad option, as one line on stderr naming what was
typed and the fix; 130 Ctrl-C (SIGINT) and 143 SIGTERM, each with one line on stderr,
``--jobs`` workers terminated and no output file written (outputs are staged and renamed
into place only at the end: ``hybridkv.outputs``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from rich.console import Console

from hybridkv.cli.argtypes import non_empty_str, non_negative_float, positive_float, positive_int
from hybridkv.cli.check_trace import cmd_check_trace
from hybridkv.cli.cluster import add_cluster_arguments, cmd_cluster
from hybridkv.cli.replay import cmd_replay
from hybridkv.cli.sweep import cmd_sweep
from hybridkv.cluster.report import CLUSTER_HELP
from hybridkv.errors import ConfigError, HybridKVError
from hybridkv.native import core_line
from hybridkv.policies import CORE_POLICIES
from hybridkv.sched.admission import ORDERS
from hybridkv.sim.report import REPORT_HELP
from hybridkv.sim.run import DEFAULT_MODEL
from hybridkv.timing import GPUS
from hybridkv.traces.source import DEFAULT_WORKLOAD

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
"""128 + SIGINT, what shells report for a Ctrl-C."""
EXIT_TERMINATED = 143
"""128 + SIGTERM."""


DETAIL_HELP = ("also print the tables of the other columns (miss causes, tokens, waiting, "
               "time); --json keeps every field")
PIPED_WIDTH = 120
"""Columns of a report written to a pipe or file, unless ``COLUMNS`` says otherwise (the
default tables fit 80)."""
MIN_REPORT_WIDTH = 80
"""Fewest columns a report is laid out in: a narrower terminal or ``COLUMNS=30`` gets the
80-column layout (the terminal wraps its lines) instead of tables whose columns are cut to
``25.`` or dropped."""


class Terminated(BaseException):
    """SIGTERM arrived (raised by the CLI's handler, so ``finally`` blocks run)."""


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` whose errors are one line on stderr (no usage block), exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridkv")
    except PackageNotFoundError:  # pragma: no cover - running from a bare source tree
        return "unknown"


def _add_source_arguments(parser: argparse.ArgumentParser, *, many: bool = False) -> None:
    group = parser if many else parser.add_mutually_exclusive_group()
    repeat = " (repeatable)" if many else ""
    group.add_argument("--trace", type=non_empty_str, action="append" if many else "store",
                       help="trace file or directory (Mooncake, WEKA, RAGPulse, native)"
                       + repeat)
    group.add_argument("--workload", type=non_empty_str, action="append" if many else "store",
                       help="synthetic workload: retention-microbench, agentic, "
                       f"aba, shared-prefix, shared-prefix-suffix, short-prompts, long-context "
                       f"(default: {DEFAULT_WORKLOAD})" + (
                           "; repeatable or comma-separated, mixes with --trace" if many
                           else ""))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="workload parameter (repeatable), e.g. --set num_sessions=8 "
                        "or --set fractions=0.1,0.5")
    parser.add_argument("--model", type=non_empty_str, default=None,
                        action="append" if many else "store",
                        help=f"preset name or a .toml path (default: {DEFAULT_MODEL})"
                        + ("; repeatable or comma-separated" if many else ""))
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="first N requests only")
    parser.add_argument("--max-running", type=positive_int, default=None,
                        help="concurrent requests (default 16, or the workload's own)")
    parser.add_argument("--chunk-size", type=positive_int, default=None,
                        help="token budget per step (default 8192)")
    parser.add_argument("--hash-algo", choices=("sha256", "xxhash"), default="sha256")
    parser.add_argument("--eagle", action="store_true", help="EAGLE/MTP (lookahead block hashes)")
    parser.add_argument("--admission", default="fcfs",
                        help="admission order(s), comma-separated or 'all': "
                        f"{', '.join(ORDERS)} (default fcfs: the protocol)")
    timing = parser.add_argument_group(
        "time model", "--clock time: requests arrive at their trace times (or --rate), each "
        "step takes what the step-time model gives it; reports TTFT, TPOT, goodput "
        "(docs/time-model.md)")
    timing.add_argument("--clock", default="step", metavar="{step,time}",
                        help="step (default: scheduler steps, the protocol) or time")
    timing.add_argument("--gpu", default="h200", metavar="NAME",
                        help=f"GPU of the time model: {', '.join(GPUS)} (default h200)")
    timing.add_argument("--tp", type=positive_int, default=1,
                        help="tensor-parallel GPUs per instance (default 1)")
    timing.add_argument("--rate", type=positive_float, default=None,
                        help="Poisson arrivals at this many requests/s instead of the "
                        "trace's times (workloads have none: required there)")
    timing.add_argument("--time-scale", type=positive_float, default=1.0,
                        help="multiply arrival times (0.5: twice the rate; default 1)")
    timing.add_argument("--slo", default=None, metavar="ttft=S,tpot=S",
                        help="goodput's limits, e.g. ttft=2,tpot=50ms")


def _add_pool_arguments(parser: argparse.ArgumentParser, *, many: bool) -> None:
    pool = parser.add_mutually_exclusive_group()
    if many:
        pool.add_argument("--num-blocks", type=non_empty_str,
                          help="comma-separated pool sizes in blocks")
        pool.add_argument("--kv-memory", type=non_empty_str,
                          help="comma-separated KV memory sizes, e.g. 8GiB,16GiB")
    else:
        pool.add_argument("--num-blocks", type=positive_int,
                          help="pool size in blocks (null included)")
        pool.add_argument("--kv-memory", type=non_empty_str,
                          help="KV memory, e.g. 40GiB (converted to blocks)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="hybridkv", description="Prefix-cache replay and verification for hybrid models")
    parser.add_argument("--version", action="version", version=f"hybridkv {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    replay = sub.add_parser("replay", help="replay a trace or workload under retention policies",
                            description=REPORT_HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_source_arguments(replay)
    _add_pool_arguments(replay, many=False)
    replay.add_argument("--policy", default="core", type=non_empty_str,
                        help="comma-separated policies, or 'core' (default): "
                        + ",".join(CORE_POLICIES))
    _add_report_arguments(replay)
    replay.add_argument("--jobs", type=positive_int, default=1,
                        help="replay policies in this many processes (default 1)")
    replay.add_argument("--host-memory", type=non_empty_str, default=None, metavar="SIZE",
                        help="a host-memory (CPU DRAM) tier behind the GPU pool: a size "
                        "(256GiB) or a multiple of the pool's bytes (8x); docs/host-tier.md")
    replay.add_argument("--host-policy", type=non_empty_str, default="aware",
                        help="host tier policy: aware (default: landing units, no dead "
                        "content), lru, lru-split[:STATE_SHARE] (HiCache-style, 0.5)")
    _add_observer_arguments(replay)

    sweep = sub.add_parser(
        "sweep", help="traces × models × pool sizes × policies → table, CSV, JSON, PNG",
        description="Replay every cell of traces × models × pool sizes × policies × "
        "admission orders, in parallel (--jobs) or on Ray (--ray). With --results DIR each "
        "finished cell is stored there and a re-run skips it (the key covers the trace's "
        "content, the model, pool, policy, admission, scheduler settings and hybridkv's "
        "code). Files are written only where --csv / --json / --plot say.")
    _add_source_arguments(sweep, many=True)
    _add_pool_arguments(sweep, many=True)
    sweep.add_argument("--policy", default="core", type=non_empty_str,
                       help="comma-separated policies, 'core' (default) or 'all'")
    sweep.add_argument("--csv", type=_path, help="write one row per cell as CSV")
    sweep.add_argument("--json", type=_path, help="write the cells as JSON")
    sweep.add_argument("--plot", type=_path,
                       help="write hit rate vs pool size, a panel per trace × model "
                       "(.png, .pdf, .svg, … by the extension)")
    sweep.add_argument("--results", type=_path, metavar="DIR",
                       help="keep finished cells in DIR (created if missing) and reuse "
                       "them: a re-run computes only the missing or changed cells")
    sweep.add_argument("--jobs", type=positive_int, default=None,
                       help="cells in this many processes (default 1; with --ray: the "
                       "local Ray's CPUs, default all)")
    sweep.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                       type=non_empty_str,
                       help="run the cells as Ray tasks: a local Ray, or the cluster at "
                       "ADDRESS (needs pip install 'hybridkv[ray]')")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    sweep.add_argument("--detail", action="store_true", help=DETAIL_HELP)

    check = sub.add_parser("check-trace", help="validate a trace and print its statistics")
    check.add_argument("path", type=non_empty_str)
    check.add_argument("--model", type=non_empty_str, default=None)
    check.add_argument("--limit", type=positive_int, default=None)

    cluster = sub.add_parser("cluster", help="replay a trace over N instances behind a router",
                             description=CLUSTER_HELP,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(cluster, _add_source_arguments,
                          lambda p: _add_pool_arguments(p, many=False))
    _add_report_arguments(cluster)

    _add_verify_parser(sub)
    return parser


def _add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """``replay``'s and ``cluster``'s report options: ``--json``, ``--plot``, ``--paranoid``,
    ``--quiet``, ``--detail``."""
    parser.add_argument("--json", type=_path, help="write the report as JSON")
    parser.add_argument("--plot", type=_path,
                        help="write a plot (.png, .pdf, .svg, … by the extension)")
    parser.add_argument("--paranoid", action="store_true",
                        help="check every invariant after every step (slow)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--detail", action="store_true", help=DETAIL_HELP)


def _add_verify_parser(sub: argparse._SubParsersAction[OneLineParser]) -> None:
    verify = sub.add_parser("verify", help="prove cache hits exact on the reference engine")
    try:
        from hybridkv.cli.verify import add_verify_arguments
    except ImportError:  # torch missing: the command explains itself when run
        verify.set_defaults(engine_missing=True)
        return
    add_verify_arguments(verify)


def _add_observer_arguments(parser: argparse.ArgumentParser) -> None:
    """KV events and Prometheus metrics of the run (``hybridkv.sim.observe``)."""
    parser.add_argument("--events", type=non_empty_str, default=None, metavar="ENDPOINT",
                        help="publish KV events in vLLM's format on a ZMQ PUB socket "
                        "(tcp://*:5557 binds; tcp://HOST:PORT connects to a subscriber)")
    parser.add_argument("--events-replay", type=non_empty_str, default=None,
                        metavar="ENDPOINT", help="ZMQ ROUTER endpoint serving replays of "
                        "buffered event batches (vLLM's replay protocol)")
    parser.add_argument("--metrics", type=non_empty_str, default=None, metavar="PORT|PATH",
                        help="Prometheus metrics: serve on this HTTP port during the run, "
                        "or write this file (text format) at the end")
    parser.add_argument("--linger-seconds", type=non_negative_float, default=0.0,
                        help="keep --events-replay and the --metrics port up this long "
                        "after the report (default 0)")


def _path(text: str) -> Path:
    """An output path; an empty one is an error (``Path("")`` would be the current
    directory)."""
    if text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"{text!r} ends in '/': name a file, not a directory")
    return Path(non_empty_str(text))


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the command runs, SIGTERM raises ``Terminated`` in the main thread (so staged
    outputs are removed and a ``--jobs`` pool is terminated on the way out)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report_console() -> Console:
    """Standard output's console: a terminal's width; for a pipe or a file ``COLUMNS``
    when set, else ``PIPED_WIDTH``; never narrower than ``MIN_REPORT_WIDTH``."""
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console = Console(width=PIPED_WIDTH)
    if console.width < MIN_REPORT_WIDTH:
        console = Console(width=MIN_REPORT_WIDTH)
    return console


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _notes(err: BaseException) -> str:
    """Notes a command added to an interruption (``add_note``; e.g. where a sweep kept its
    finished cells), appended to the one line."""
    return "".join(f"; {_one_line(note)}" for note in getattr(err, "__notes__", ()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    name = "hybridkv"
    try:
        with _sigterm_raises():
            args = parser.parse_args(argv)
            name = f"hybridkv {args.command}"
            if sys.stdout is None:  # started with descriptor 1 closed (``>&-``)
                raise ConfigError("stdout", "closed", "the report has nowhere to go; "
                                  "redirect it to a file or /dev/null instead of closing it")
            console = _report_console()
            err_console = Console(stderr=True)
            commands: dict[str, Callable[[argparse.Namespace, Console, Console], int]] = {
                "replay": cmd_replay, "sweep": cmd_sweep, "check-trace": cmd_check_trace,
                "verify": _cmd_verify, "cluster": cmd_cluster,
            }
            status = commands[args.command](args, console, err_console)
            if status == 0:  # the report's last line: which core ran (a speed figure's "on what")
                console.print(core_line(), highlight=False, markup=False)
            return status
    except HybridKVError as err:
        print(f"{name}: error: {_one_line(str(err))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as err:
        print(f"{name}: interrupted (Ctrl-C); no output written{_notes(err)}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated as err:
        print(f"{name}: terminated (SIGTERM); no output written{_notes(err)}",
              file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:  # stdout closed early (| head): nothing left to say
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - flushed at exit, never closed
        return 1


def _cmd_verify(args: argparse.Namespace, console: Console, err_console: Console) -> int:
    if getattr(args, "engine_missing", False):
        raise ConfigError("verify", "torch", "install the engine extra; from a checkout: "
                          "pip install -e '.[engine]' (or pip install torch safetensors)")
    from hybridkv.cli.verify import cmd_verify

    return int(cmd_verify(args))


__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
