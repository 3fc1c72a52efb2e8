"""Probe suite (issue 12): malformed and adversarial input to every command.

Every probe runs ``hybridkv.cli.main`` in-process and asserts what a user sees: the exit
code, that a failure is exactly one line on stderr naming what was typed (a fragment of
the expected message), never a traceback, and that no output file (partial or temporary)
is left behind. The signal probes at the end run the CLI in a real subprocess.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import stat
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_harness import SRC, TINY_MODEL, needs_proc
from cli_harness import alive as _alive
from cli_harness import children as _children
from cli_harness import spawn_cli as _spawn
from cli_harness import wait_busy as _wait_busy
from cli_harness import wait_for as _wait_for

from hybridkv.cli import main
from hybridkv.traces.loaders import fields

WINDOW_ONLY_MODEL = """
block_size = 16
kv_bytes_per_token = 64
[[layers]]
kind = "sliding_window"
window = 32
count = 2
"""

MOONCAKE_LINE = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}


def _jsonl(*objects: object) -> str:
    return "".join(json.dumps(o) + "\n" for o in objects)


def _write_inputs(d: Path) -> None:
    """Every input file the probes name, in one directory (``{d}`` in an argv)."""
    (d / "tiny.toml").write_text(TINY_MODEL)
    (d / "win.toml").write_text(WINDOW_ONLY_MODEL)
    files: dict[str, str | bytes] = {
        "good.jsonl": _jsonl(MOONCAKE_LINE, {**MOONCAKE_LINE, "hash_ids": [1, 3]}),
        "empty.jsonl": "",
        "blank.jsonl": "\n  \n\n",
        "notjson.jsonl": "{this is not json\n",
        "array.jsonl": "[1, 2, 3]\n",
        "deep.jsonl": "[" * 100_000 + "]" * 100_000 + "\n",
        "deep-object.jsonl": '{"a":' * 50_000 + "1" + "}" * 50_000 + "\n",
        "bigint.jsonl": '{"timestamp": 0, "input_length": ' + "9" * 5000 + "}\n",
        "binary.jsonl": b"\xff\xfe\x00\x81garbage\n",
        "nofield.jsonl": _jsonl({"timestamp": 0, "input_length": 5, "output_length": 1}),
        "negative.jsonl": _jsonl({**MOONCAKE_LINE, "input_length": -5}),
        "mismatch.jsonl": _jsonl({**MOONCAKE_LINE, "hash_ids": [1]}),
        "floatlen.jsonl": _jsonl({**MOONCAKE_LINE, "input_length": 600.5}),
        "nanstamp.jsonl": '{"timestamp": NaN, "input_length": 600, "output_length": 2, '
                          '"hash_ids": [1, 2]}\n',
        "huge-output.jsonl": _jsonl({**MOONCAKE_LINE, "output_length": 1_000_000_000}),
        "long-prompt.jsonl": _jsonl({"timestamp": 0, "input_length": 10_000_000,
                                     "output_length": 1,
                                     "hash_ids": list(range(-(-10_000_000 // 512)))}),
        "too-long-prompt.jsonl": _jsonl({"timestamp": 0, "input_length": 1 << 25,
                                         "output_length": 1,
                                         "hash_ids": list(range((1 << 25) // 512))}),
        "native-unknown.jsonl": _jsonl({"tokens": [1, 2], "output_length": 1, "bogus": 1}),
        "native-dup.jsonl": _jsonl({"id": "a", "tokens": [1], "output_length": 1},
                                   {"id": "a", "tokens": [2], "output_length": 1}),
        "native-header-only.jsonl": _jsonl({"hybridkv_trace": 1, "name": "x"}),
        "native-badrange.jsonl": _jsonl({"token_ranges": [[5, 2]], "output_length": 1}),
        "native-hugetoken.jsonl": _jsonl({"tokens": [1 << 60], "output_length": 1}),
        "unknown-format.jsonl": _jsonl({"prompt": "hello"}),
        "conv.json": json.dumps({"block_size": 64, "requests": [
            {"t": 0, "in": 100, "out": 2, "hash_ids": [1]}]}),
        "empty.json": "",
        "deep.json": "[" * 100_000 + "]" * 100_000,
        "conv-list.json": "[]",
        "corrupt.json.gz": b"\x1f\x8b\x08\x00garbage-not-deflate" * 4,
        "notgzip.json.gz": b"plain text, not gzip",
        "truncated.json.gz": gzip.compress(b'{"requests": []}' * 100)[:40],
        "deflate.json.gz": _corrupt_deflate(),
        "model-empty.toml": "",
        "model-bad.toml": "block_size = [\n",
        "model-layers.toml": "block_size = 16\nkv_bytes_per_token = 64\n[[layers]]\n"
                             'kind = "full_attention"\ncount = 1000000000\n',
        "model-numlayers.toml": 'block_size = 16\nkv_bytes_per_token = 64\nnum_layers = '
                                '1000000000\npattern = ["g"]\n[kinds.g]\n'
                                'kind = "full_attention"\n',
        "model-deep.toml": "a = " + "[" * 100_000 + "]" * 100_000 + "\n",
        "model-bigint.toml": "block_size = " + "9" * 5000 + "\n",
        "model-unknown.toml": TINY_MODEL + "\nbogus = 1\n",
        "model-zero.toml": TINY_MODEL.replace("block_size = 16", "block_size = 0"),
        "model-bs24.toml": TINY_MODEL.replace("window = 32", "window = 32\nblock_size = 24"),
        "model-kind.toml": TINY_MODEL.replace('"full_attention"', '"mamba"'),
        "model-windowless.toml": TINY_MODEL.replace("window = 32\n", ""),
        "file.txt": "a regular file\n",
    }
    for name, content in files.items():
        path = d / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    (d / "emptydir").mkdir()
    (d / "ragpulse").mkdir()
    (d / "ragpulse" / "0_trace.jsonl").write_text("")
    os.mkfifo(d / "fifo.jsonl")
    os.mkfifo(d / "fifo.toml")
    (d / "zero-link.jsonl").symlink_to("/dev/zero")


def _corrupt_deflate() -> bytes:
    """A gzip member with a valid header whose deflate stream is broken in the middle."""
    data = bytearray(gzip.compress(json.dumps({"requests": list(range(5000))}).encode()))
    for i in range(20, 60):
        data[i] ^= 0x5A
    return bytes(data)


@dataclass(frozen=True)
class Outcome:
    code: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("probe-inputs")
    _write_inputs(d)
    return d


@pytest.fixture
def out(tmp_path: Path) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Outcome:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse: --help, --version, bad options
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err)


def assert_clean_failure(outcome: Outcome, code: int, fragment: str) -> None:
    """Exit ``code``, exactly one line on stderr containing ``fragment``, no traceback."""
    assert "Traceback" not in outcome.stderr + outcome.stdout, \
        f"a traceback:\n{outcome.stderr}"
    lines = outcome.stderr.strip().splitlines()
    assert len(lines) == 1, f"stderr is {len(lines)} lines:\n{outcome.stderr}"
    assert fragment.lower() in lines[0].lower(), f"no {fragment!r} in: {lines[0]}"
    assert outcome.code == code, f"exit {outcome.code}, expected {code}: {lines[0]}"


def assert_nothing_written(folder: Path) -> None:
    left = sorted(p.name for p in folder.iterdir())
    assert left == [], f"left behind: {left}"


QUICK = ["--workload", "aba", "--set", "prompt_tokens=64", "--set", "output_tokens=2",
         "--model", "{d}/tiny.toml", "--policy", "latest", "--quiet"]
"""A replay that takes milliseconds (for probes that get past the checks)."""

REPLAY = ["replay", *QUICK]
SWEEP = ["sweep", *QUICK, "--csv", "{out}/s.csv", "--plot", "{out}/s.png"]

# (id, argv, exit code, fragment of the one stderr line)
PROBES: list[tuple[str, list[str], int, str]] = [
    # -- explicit empty / zero / negative values: errors, never a silent default
    ("trace-empty", ["replay", "--trace", ""], 2, "--trace: must not be empty"),
    ("workload-empty", ["replay", "--workload", ""], 2, "--workload: must not be empty"),
    ("model-empty", [*REPLAY, "--model", ""], 2, "--model: must not be empty"),
    ("max-running-0", [*REPLAY, "--max-running", "0"], 2, "--max-running"),
    ("max-running-neg", [*REPLAY, "--max-running", "-3"], 2, "--max-running"),
    ("max-running-text", [*REPLAY, "--max-running", "many"], 2, "'many'"),
    ("chunk-size-0", [*REPLAY, "--chunk-size", "0"], 2, "--chunk-size"),
    ("chunk-size-neg", [*REPLAY, "--chunk-size", "-8"], 2, "--chunk-size"),
    ("limit-0", [*REPLAY, "--limit", "0"], 2, "--limit"),
    ("limit-neg", [*REPLAY, "--limit", "-1"], 2, "--limit"),
    ("limit-huge-digits", [*REPLAY, "--limit", "9" * 5000], 2, "at most 30 digits"),
    ("num-blocks-0", [*REPLAY, "--num-blocks", "0"], 2, "--num-blocks"),
    ("num-blocks-1", [*REPLAY, "--num-blocks", "1"], 2, "must be >= 2"),
    ("num-blocks-neg", [*REPLAY, "--num-blocks", "-5"], 2, "--num-blocks"),
    ("num-blocks-text", [*REPLAY, "--num-blocks", "lots"], 2, "'lots'"),
    ("num-blocks-float", [*REPLAY, "--num-blocks", "12.5"], 2, "'12.5'"),
    ("kv-memory-empty", [*REPLAY, "--kv-memory", ""], 2, "--kv-memory: must not be empty"),
    ("kv-memory-0", [*REPLAY, "--kv-memory", "0"], 2, "--kv-memory"),
    ("kv-memory-neg", [*REPLAY, "--kv-memory", "-1GiB"], 2, "--kv-memory"),
    ("kv-memory-unit", [*REPLAY, "--kv-memory", "12XB"], 2, "--kv-memory"),
    ("kv-memory-tiny", [*REPLAY, "--kv-memory", "100B"], 2, "at least two blocks"),
    ("kv-memory-long", [*REPLAY, "--kv-memory", "1" * 5000], 2, "--kv-memory"),
    ("jobs-0", [*REPLAY, "--jobs", "0"], 2, "--jobs"),
    ("jobs-neg", [*REPLAY, "--jobs", "-2"], 2, "--jobs"),
    ("policy-empty", [*REPLAY[:-3], "--policy", ""], 2, "--policy: must not be empty"),
    ("policy-commas", [*REPLAY[:-3], "--policy", ","], 2, "--policy"),
    ("policy-hole", [*REPLAY[:-3], "--policy", "latest,,dense"], 2, "empty name"),
    ("policy-typo", [*REPLAY[:-3], "--policy", "lastest"], 2, "did you mean 'latest'"),
    ("policy-typo-modifier", [*REPLAY[:-3], "--policy", "latest+scna"], 2,
     "did you mean 'latest+scan'"),
    ("policy-interval-text", [*REPLAY[:-3], "--policy", "interval:abc"], 2, "interval"),
    ("policy-unknown", [*REPLAY[:-3], "--policy", "zzzzqqq"], 2, "--policy='zzzzqqq'"),
    ("hash-algo", [*REPLAY, "--hash-algo", "md5"], 2, "--hash-algo"),
    ("json-empty", [*REPLAY, "--json", ""], 2, "--json: must not be empty"),
    ("plot-empty", [*REPLAY, "--plot", ""], 2, "--plot: must not be empty"),
    ("unknown-flag", [*REPLAY, "--bogus"], 2, "unrecognized arguments: --bogus"),
    ("no-command", [], 2, "required: command"),
    ("unknown-command", ["replya"], 2, "invalid choice: 'replya'"),
    ("trace-and-workload", ["replay", "--trace", "x", "--workload", "aba"], 2,
     "not allowed with"),
    # -- --set, for every workload
    ("set-empty", [*REPLAY, "--set", ""], 2, "use KEY=VALUE"),
    ("set-no-equals", [*REPLAY, "--set", "prompt_tokens"], 2, "use KEY=VALUE"),
    ("set-no-key", [*REPLAY, "--set", "=5"], 2, "use KEY=VALUE"),
    ("set-no-value", [*REPLAY, "--set", "seed="], 2, "give seed a value"),
    ("set-twice", [*REPLAY, "--set", "prompt_tokens=32"], 2, "set twice"),
    ("set-unknown-aba", [*REPLAY, "--set", "bogus=1"], 2, "accepts only"),
    ("set-typo-aba", [*REPLAY, "--set", "prompt_token=8"], 2, "did you mean 'prompt_tokens'"),
    ("set-unknown-default", ["replay", "--set", "bogus=1"], 2, "accepts only"),
    ("set-unknown-shared", ["replay", "--workload", "shared-prefix", "--set", "bogus=1"], 2,
     "accepts only"),
    ("set-unknown-micro", ["replay", "--workload", "retention-microbench", "--set",
                           "bogus=1"], 2, "accepts only"),
    ("set-zero-sessions", ["replay", "--workload", "agentic", "--set", "num_sessions=0"], 2,
     "num_sessions=0"),
    ("set-text-int", ["replay", "--workload", "agentic", "--set", "num_sessions=abc"], 2,
     "must parse as int"),
    ("set-float-int", ["replay", "--workload", "agentic", "--set", "num_turns=1.5"], 2,
     "must parse as int"),
    ("set-bigint", ["replay", "--workload", "agentic", "--set", "num_turns=" + "9" * 5000],
     2, "must parse as int"),
    ("set-jitter-nan", ["replay", "--workload", "agentic", "--set", "length_jitter=nan"], 2,
     "length_jitter"),
    ("set-jitter-2", ["replay", "--workload", "agentic", "--set", "length_jitter=2"], 2,
     "length_jitter"),
    ("set-seed-neg", [*REPLAY, "--set", "seed=-1"], 2, "seed"),
    ("set-seed-huge", [*REPLAY, "--set", "seed=99999"], 2, "seed"),
    ("set-bool", ["replay", "--workload", "shared-prefix", "--set", "warmup=maybe"], 2,
     "must parse as bool"),
    ("set-fraction-0", ["replay", "--workload", "retention-microbench", "--set",
                        "fractions=0"], 2, "fraction"),
    ("set-fraction-nan", ["replay", "--workload", "retention-microbench", "--set",
                          "fractions=nan"], 2, "fraction"),
    ("set-fraction-text", ["replay", "--workload", "retention-microbench", "--set",
                           "fractions=half"], 2, "must parse as tuple"),
    ("set-fraction-hole", ["replay", "--workload", "retention-microbench", "--set",
                           "fractions=0.1,,0.5"], 2, "must parse as tuple"),
    ("set-with-trace", ["replay", "--trace", "{d}/good.jsonl", "--set", "seed=1"], 2,
     "need --workload"),
    ("workload-unknown", ["replay", "--workload", "nonesuch"], 2, "choose one of"),
    ("workload-typo", ["replay", "--workload", "agentc"], 2, "did you mean 'agentic'"),
    # -- traces: missing, not regular files, malformed
    ("trace-missing", ["replay", "--trace", "{d}/missing.jsonl"], 2, "does not exist"),
    ("trace-fifo", ["replay", "--trace", "{d}/fifo.jsonl"], 2, "not a regular file"),
    ("trace-dev-zero", ["replay", "--trace", "/dev/zero"], 2, "not a regular file"),
    ("trace-dev-null", ["replay", "--trace", "/dev/null"], 2, "not a regular file"),
    ("trace-link-zero", ["replay", "--trace", "{d}/zero-link.jsonl"], 2,
     "not a regular file"),
    ("trace-empty-file", ["replay", "--trace", "{d}/empty.jsonl"], 2, "is empty"),
    ("trace-blank", ["replay", "--trace", "{d}/blank.jsonl"], 2, "is empty"),
    ("trace-not-json", ["replay", "--trace", "{d}/notjson.jsonl"], 2, "invalid JSON"),
    ("trace-array", ["replay", "--trace", "{d}/array.jsonl"], 2, "must be a JSON object"),
    ("trace-deep", ["replay", "--trace", "{d}/deep.jsonl"], 2, "nested too deeply"),
    ("trace-deep-object", ["replay", "--trace", "{d}/deep-object.jsonl"], 2,
     "nested too deeply"),
    ("trace-bigint", ["replay", "--trace", "{d}/bigint.jsonl"], 2, "4300 digits"),
    ("trace-binary", ["replay", "--trace", "{d}/binary.jsonl"], 2, "cannot be read"),
    ("trace-no-field", ["replay", "--trace", "{d}/nofield.jsonl"], 2, "'hash_ids'"),
    ("trace-negative", ["replay", "--trace", "{d}/negative.jsonl"], 2, "'input_length'"),
    ("trace-mismatch", ["replay", "--trace", "{d}/mismatch.jsonl"], 2, "'hash_ids'"),
    ("trace-float-length", ["replay", "--trace", "{d}/floatlen.jsonl"], 2, "'input_length'"),
    ("trace-nan-stamp", ["replay", "--trace", "{d}/nanstamp.jsonl"], 2, "'timestamp'"),
    ("trace-too-long-prompt", ["replay", "--trace", "{d}/too-long-prompt.jsonl"], 2,
     "input_length"),
    ("trace-native-unknown", ["replay", "--trace", "{d}/native-unknown.jsonl"], 2, "'bogus'"),
    ("trace-native-dup", ["replay", "--trace", "{d}/native-dup.jsonl"], 2, "repeats"),
    ("trace-native-header-only", ["replay", "--trace", "{d}/native-header-only.jsonl"], 2,
     "holds no requests"),
    ("trace-native-range", ["replay", "--trace", "{d}/native-badrange.jsonl"], 2,
     "start < end"),
    ("trace-native-token", ["replay", "--trace", "{d}/native-hugetoken.jsonl"], 2, "< "),
    ("trace-unknown-format", ["replay", "--trace", "{d}/unknown-format.jsonl"], 2,
     "cannot tell the format"),
    ("trace-empty-dir", ["replay", "--trace", "{d}/emptydir"], 2, "neither"),
    ("trace-ragpulse-partial", ["replay", "--trace", "{d}/ragpulse"], 2, "is missing"),
    ("trace-weka-empty", ["replay", "--trace", "{d}/empty.json"], 2, "is empty"),
    ("trace-weka-deep", ["replay", "--trace", "{d}/deep.json"], 2, "nested too deeply"),
    ("trace-weka-list", ["replay", "--trace", "{d}/conv-list.json"], 2, "JSON object"),
    ("trace-gzip-corrupt", ["replay", "--trace", "{d}/corrupt.json.gz"], 2, "cannot be read"),
    ("trace-gzip-plain", ["replay", "--trace", "{d}/notgzip.json.gz"], 2, "cannot be read"),
    ("trace-gzip-truncated", ["replay", "--trace", "{d}/truncated.json.gz"], 2,
     "cannot be read"),
    ("trace-deflate-corrupt", ["replay", "--trace", "{d}/deflate.json.gz"], 2,
     "cannot be read"),
    ("check-trace-empty", ["check-trace", ""], 2, "path: must not be empty"),
    ("check-trace-missing", ["check-trace", "{d}/missing.jsonl"], 2, "does not exist"),
    ("check-trace-fifo", ["check-trace", "{d}/fifo.jsonl"], 2, "not a regular file"),
    ("check-trace-dev-zero", ["check-trace", "/dev/zero"], 2, "not a regular file"),
    ("check-trace-limit-0", ["check-trace", "{d}/good.jsonl", "--limit", "0"], 2, "--limit"),
    ("check-trace-model-empty", ["check-trace", "{d}/good.jsonl", "--model", ""], 2,
     "--model"),
    ("check-trace-deep", ["check-trace", "{d}/deep.jsonl"], 2, "nested too deeply"),
    ("check-trace-gzip", ["check-trace", "{d}/deflate.json.gz"], 2, "cannot be read"),
    # -- model files
    ("model-missing", [*REPLAY, "--model", "{d}/nope.toml"], 2, "not a bundled preset"),
    ("model-preset-typo", [*REPLAY, "--model", "gemma3-bnech"], 2, "not a bundled preset"),
    ("model-dir", [*REPLAY, "--model", "{d}/emptydir"], 2, "not a bundled preset"),
    ("model-fifo", [*REPLAY, "--model", "{d}/fifo.toml"], 2, "not a bundled preset"),
    ("model-empty-file", [*REPLAY, "--model", "{d}/model-empty.toml"], 2, "layers"),
    ("model-bad-toml", [*REPLAY, "--model", "{d}/model-bad.toml"], 2, "invalid TOML"),
    ("model-layer-count", [*REPLAY, "--model", "{d}/model-layers.toml"], 2,
     "more than 1024 layers"),
    ("model-num-layers", [*REPLAY, "--model", "{d}/model-numlayers.toml"], 2,
     "at most 1024 layers"),
    ("model-deep", [*REPLAY, "--model", "{d}/model-deep.toml"], 2, "nested too deeply"),
    ("model-bigint", [*REPLAY, "--model", "{d}/model-bigint.toml"], 2, "4300 digits"),
    ("model-unknown-key", [*REPLAY, "--model", "{d}/model-unknown.toml"], 2, "unknown key"),
    ("model-zero-block", [*REPLAY, "--model", "{d}/model-zero.toml"], 2, "block_size"),
    # core's interval:32768 is no multiple of a 16 + 24-token model's 48-token hit unit
    ("model-core-misaligned", [*REPLAY, "--model", "{d}/model-bs24.toml", "--policy", "core"],
     2, "--policy='interval:32768' is invalid: must be a positive multiple of the hit "
        "alignment 48 tokens (lcm of the groups' block sizes), e.g. 32736; --policy core "
        "includes it"),
    ("model-policy-misaligned", [*REPLAY, "--model", "{d}/model-bs24.toml", "--policy",
                                 "latest,interval:100"], 2, "--policy='interval:100' is invalid"),
    ("sweep-core-misaligned", [*SWEEP, "--num-blocks", "200", "--model", "{d}/model-bs24.toml",
                               "--policy", "core"], 2, "--policy core includes it"),
    ("cluster-policy-misaligned", ["cluster", *QUICK, "--num-blocks", "200", "--model",
                                   "{d}/model-bs24.toml", "--policy", "interval:32768"], 2,
     "--policy='interval:32768' is invalid"),
    ("model-bad-kind", [*REPLAY, "--model", "{d}/model-kind.toml"], 2, "kind"),
    ("model-no-window", [*REPLAY, "--model", "{d}/model-windowless.toml"], 2, "window"),
    # -- pools: too small for a request (named, with the blocks it needs), too big for RAM
    ("pool-too-small", [*REPLAY, "--num-blocks", "2"], 2, "request 'A'"),
    ("pool-too-small-window", [*REPLAY, "--model", "{d}/win.toml", "--num-blocks", "3"], 2,
     "request 'A'"),
    ("pool-too-small-decode", ["replay", "--workload", "aba", "--set", "prompt_tokens=64",
                               "--set", "output_tokens=2000", "--model", "{d}/tiny.toml",
                               "--num-blocks", "40", "--quiet"], 2, "(2063 tokens)"),
    ("pool-huge-output", ["replay", "--trace", "{d}/huge-output.jsonl", "--quiet"], 2,
     "request 'mooncake-0'"),
    ("pool-long-prompt", ["replay", "--trace", "{d}/long-prompt.jsonl", "--quiet"], 2,
     "request 'mooncake-0'"),
    ("pool-too-small-names-trace", ["replay", "--trace", "{d}/long-prompt.jsonl",
                                    "--quiet"], 2, "long-prompt.jsonl' needs at least"),
    ("pool-too-small-names-workload", [*REPLAY, "--num-blocks", "2"], 2,
     "of workload 'aba' needs at least"),
    ("pool-blocks-ram", [*REPLAY, "--num-blocks", "1000000000000"], 2, "of host memory"),
    ("pool-bytes-ram", [*REPLAY, "--kv-memory", "1000TiB"], 2, "--kv-memory='1000TiB'"),
    ("pool-jobs-ram", [*REPLAY, "--num-blocks", "20000000000", "--jobs", "8"], 2,
     "in each of 8 processes"),
    # -- output paths, all refused before any replay (the default workload would take
    #    minutes: these return at once)
    ("json-missing-dir", ["replay", "--json", "{out}/no/such/r.json"], 2,
     "does not exist"),
    ("json-is-dir", ["replay", "--json", "{out}"], 2, "is a directory"),
    ("json-trailing-slash", ["replay", "--json", "{out}/r.json/"], 2, "ends in '/'"),
    ("json-dev-full", ["replay", "--json", "/dev/full"], 2, "not a regular file"),
    ("json-dev-null", ["replay", "--json", "/dev/null"], 2, "not a regular file"),
    ("json-parent-file", ["replay", "--json", "{d}/file.txt/r.json"], 2, "not a directory"),
    ("json-proc", ["replay", "--json", "/proc/hybridkv-probe.json"], 2,
     "cannot create files"),
    ("plot-bad-ext", ["replay", "--json", "{out}/r.json", "--plot", "{out}/r.xyz"], 2,
     "'.xyz' is not a plot format"),
    ("plot-no-ext", ["replay", "--plot", "{out}/plot"], 2, "has no extension"),
    ("plot-json-ext", ["replay", "--plot", "{out}/p.json"], 2, "not a plot format"),
    ("plot-missing-dir", ["replay", "--plot", "{out}/x/p.png"], 2, "does not exist"),
    ("plot-fifo", ["replay", "--plot", "{d}/fifo.jsonl"], 2, "not a regular file"),
    ("json-plot-same-file", ["replay", "--json", "{out}/r.png", "--plot", "{out}/r.png"], 2,
     "same file as --json"),
    ("metrics-json-same-file", ["replay", "--json", "{out}/r.prom", "--metrics",
                                "{out}/r.prom"], 2, "same file as --json"),
    ("sweep-csv-empty", [*SWEEP, "--num-blocks", "200", "--csv", ""], 2, "--csv"),
    ("sweep-csv-dir", [*SWEEP, "--num-blocks", "200", "--csv", "{out}"], 2,
     "is a directory"),
    ("sweep-csv-missing-dir", [*SWEEP, "--num-blocks", "200", "--csv", "{out}/n/s.csv"], 2,
     "does not exist"),
    ("sweep-csv-dev-full", [*SWEEP, "--num-blocks", "200", "--csv", "/dev/full"], 2,
     "not a regular file"),
    ("sweep-plot-ext", [*SWEEP, "--num-blocks", "200", "--plot", "{out}/s.txt"], 2,
     "not a plot format"),
    ("sweep-same-file", [*SWEEP, "--num-blocks", "200", "--plot", "{out}/s.csv"], 2,
     "not a plot format"),
    # -- sweep pool lists
    ("sweep-no-pool", SWEEP, 2, "needs --num-blocks or --kv-memory"),
    ("sweep-blocks-empty", [*SWEEP, "--num-blocks", ""], 2, "--num-blocks"),
    ("sweep-blocks-hole", [*SWEEP, "--num-blocks", "200,,300"], 2, "empty item"),
    ("sweep-blocks-text", [*SWEEP, "--num-blocks", "200,lots"], 2, "'lots'"),
    ("sweep-blocks-1", [*SWEEP, "--num-blocks", "1"], 2, "must be >= 2"),
    ("sweep-blocks-neg", [*SWEEP, "--num-blocks", "200,-4"], 2, "'-4'"),
    ("sweep-memory-bad", [*SWEEP, "--kv-memory", "1GiB,lots"], 2, "--kv-memory"),
    ("sweep-blocks-ram", [*SWEEP, "--num-blocks", "1000000000000"], 2, "of host memory"),
    ("sweep-policy-typo", [*SWEEP, "--num-blocks", "200", "--policy", "pin:x"], 2, "pin"),
    # -- verify (option checks run before torch is needed)
    ("verify-atol-nan", ["verify", "--atol", "nan"], 2, "--atol"),
    ("verify-atol-neg", ["verify", "--atol", "-1"], 2, "--atol"),
    ("verify-atol-inf", ["verify", "--atol", "inf"], 2, "--atol"),
    ("verify-block-size-0", ["verify", "--block-size", "0"], 2, "--block-size"),
    ("verify-num-blocks-0", ["verify", "--num-blocks", "0"], 2, "--num-blocks"),
    ("verify-chunk-0", ["verify", "--chunk-size", "0"], 2, "--chunk-size"),
    ("verify-running-0", ["verify", "--max-running", "0"], 2, "--max-running"),
    ("verify-layers-0", ["verify", "--layers", "0"], 2, "--layers"),
    ("verify-window-neg", ["verify", "--window", "-4"], 2, "--window"),
    ("verify-seed-neg", ["verify", "--seed", "-1"], 2, "--seed"),
    ("verify-policy-empty", ["verify", "--policy", ""], 2, "--policy"),
    # options that would be ignored are refused, naming the option and the fix
    ("verify-limit-without-trace", ["verify", "--limit", "5"], 2,
     "--limit=5 is invalid: applies to --trace only"),
    ("verify-max-tokens-without-trace", ["verify", "--trace-max-tokens", "64"], 2,
     "--trace-max-tokens=64 is invalid: applies to --trace only"),
    ("verify-workload-and-trace", ["verify", "--trace", "{d}/good.jsonl", "--workload",
                                   "mixed"], 2, "--workload='mixed' is invalid: --trace"),
    ("verify-trace-max-tokens-vacuous", ["verify", "--trace", "{d}/good.jsonl",
                                         "--trace-max-tokens", "15"], 2,
     "--trace-max-tokens=15 is invalid: prompts cut below two 8-token blocks"),
    ("verify-hca-without-v4", ["verify", "--hca-ratio", "4"], 2,
     "--hca-ratio=4 is invalid: applies to --pattern v4 only"),
    ("verify-topk-without-v4", ["verify", "--pattern", "qwen3-next", "--index-topk", "2"], 2,
     "--index-topk=2 is invalid: applies to --pattern v4 only"),
    ("verify-chunk-without-llama4", ["verify", "--attention-chunk", "8"], 2,
     "--attention-chunk=8 is invalid: applies to --pattern llama4 and mixed only"),
]


def _argv(template: list[str], d: Path, out: Path) -> list[str]:
    return [arg.replace("{d}", str(d)).replace("{out}", str(out)) for arg in template]


@pytest.mark.parametrize(("argv", "code", "fragment"),
                         [pytest.param(a, c, f, id=i) for i, a, c, f in PROBES])
def test_probe(argv: list[str], code: int, fragment: str, inputs: Path, out: Path,
               capsys: pytest.CaptureFixture[str]) -> None:
    outcome = run_cli(_argv(argv, inputs, out), capsys)
    assert_clean_failure(outcome, code, fragment)
    assert_nothing_written(out)


def test_the_probe_checks_can_fail() -> None:
    """The checker rejects a traceback, a second line, a wrong code and a leftover file."""
    traceback = Outcome(1, "", "Traceback (most recent call last):\n  ...\nValueError: x\n")
    with pytest.raises(AssertionError, match="a traceback"):
        assert_clean_failure(traceback, 1, "ValueError")
    with pytest.raises(AssertionError, match="stderr is 2 lines"):
        assert_clean_failure(Outcome(2, "", "usage: hybridkv\nhybridkv: error: x\n"), 2, "x")
    with pytest.raises(AssertionError, match="exit 1, expected 2"):
        assert_clean_failure(Outcome(1, "", "hybridkv: error: x\n"), 2, "x")
    with pytest.raises(AssertionError, match="no 'other' in"):
        assert_clean_failure(Outcome(2, "", "hybridkv: error: x\n"), 2, "other")
    assert_clean_failure(Outcome(2, "", "hybridkv: error: x\n"), 2, "x")  # the control


def test_the_nothing_written_check_can_fail(out: Path) -> None:
    (out / ".hybridkv-leftover.tmp").write_text("")
    with pytest.raises(AssertionError, match="left behind"):
        assert_nothing_written(out)


# ---------------------------------------------------------------- limits (patched small)
def test_line_length_limit(inputs: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setattr(fields, "MAX_LINE_CHARS", 1000)
    trace = tmp_path / "noline.jsonl"
    trace.write_text("x" * 5000)  # no newline at all: read stops at the limit
    outcome = run_cli(["replay", "--trace", str(trace)], capsys)
    assert_clean_failure(outcome, 2, "longer than 1,000 characters")


def test_decompressed_size_limit(monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setattr(fields, "MAX_DOCUMENT_CHARS", 10_000)
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b" " * 1_000_000 + b"{}"))  # 1 KB compressed, 1 MB inside
    assert bomb.stat().st_size < 10_000
    outcome = run_cli(["replay", "--trace", str(bomb)], capsys)
    assert_clean_failure(outcome, 2, "more than 10,000 characters (decompressed)")


def test_unreadable_directory(monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A chmod-000 directory (simulated when running as root, which ignores modes)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    (folder / "a.json").write_text("{}")
    folder.chmod(0)
    try:
        if os.geteuid() == 0:
            def refuse(self: Path) -> Iterator[Path]:
                raise PermissionError(13, "Permission denied", str(self))

            monkeypatch.setattr(Path, "iterdir", refuse)
        outcome = run_cli(["replay", "--trace", str(folder)], capsys)
        assert_clean_failure(outcome, 2, "permission")
    finally:
        folder.chmod(stat.S_IRWXU)


def test_output_write_failure_leaves_nothing(inputs: Path, out: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A disk that fills up while the plot is written (after the JSON was staged): the
    run fails with one line and neither file, nor a temporary one, is left."""
    from hybridkv.sim import report

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "plot_policies", disk_full)
    monkeypatch.setattr("hybridkv.cli.replay.plot_policies", disk_full)
    outcome = run_cli(_argv([*REPLAY, "--num-blocks", "200", "--json", "{out}/r.json",
                             "--plot", "{out}/r.png"], inputs, out), capsys)
    assert_clean_failure(outcome, 2, "No space left on device")
    assert_nothing_written(out)


def test_failed_run_keeps_the_old_output(inputs: Path, out: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (out / "r.json").write_text("old\n")
    outcome = run_cli(_argv([*REPLAY, "--num-blocks", "2", "--json", "{out}/r.json"],
                            inputs, out), capsys)
    assert_clean_failure(outcome, 2, "request 'A'")
    assert (out / "r.json").read_text() == "old\n"
    assert sorted(p.name for p in out.iterdir()) == ["r.json"]


# ---------------------------------------------------------------- what succeeds
def test_outputs_are_written_whole_with_normal_permissions(
        inputs: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outcome = run_cli(_argv([*REPLAY, "--num-blocks", "200", "--json", "{out}/r.json",
                             "--plot", "{out}/r.svg"], inputs, out), capsys)
    assert outcome.code == 0, outcome.stderr
    assert sorted(p.name for p in out.iterdir()) == ["r.json", "r.svg"]
    doc = json.loads((out / "r.json").read_text())
    assert doc["settings"]["pool_bytes"] == doc["settings"]["num_blocks"] * 2 * 16 * 64
    assert (out / "r.svg").read_text().lstrip().startswith("<?xml")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((out / "r.json").stat().st_mode) == 0o666 & ~umask


def test_report_states_pool_and_workload(inputs: Path, out: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    outcome = run_cli(_argv([*REPLAY, "--num-blocks", "100"], inputs, out), capsys)
    assert outcome.code == 0, outcome.stderr
    assert ("pool 100 blocks × 16 tokens = 1,600 token slots, 200.0 KiB; workload aba "
            "(prompt_tokens=64, output_tokens=2)") in outcome.stdout


def test_microbench_fraction_lists_parse(inputs: Path, out: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    for fractions, keys in (("0.1,0.5", ["0.1", "0.5"]), ("0.5", ["0.5"])):
        outcome = run_cli(_argv(["replay", "--workload", "retention-microbench", "--set",
                                 f"fractions={fractions}", "--set", "num_prompts=2", "--set",
                                 "prompt_tokens=64", "--set", "output_tokens=1", "--model",
                                 "{d}/tiny.toml", "--policy", "latest", "--quiet", "--json",
                                 "{out}/m.json", "--num-blocks", "200"], inputs, out), capsys)
        assert outcome.code == 0, outcome.stderr
        doc = json.loads((out / "m.json").read_text())
        assert list(doc["runs"][0]["fractions"]) == keys


def test_sweep_reports_too_small_pools_as_cell_results(
        inputs: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pool too small for the trace is a result of the sweep (exit 0), in the table,
    the CSV, the JSON and the plot; the same pool in a single replay is an error."""
    outcome = run_cli(_argv([*SWEEP, "--num-blocks", "2,200", "--json", "{out}/s.json"],
                            inputs, out), capsys)
    assert outcome.code == 0, outcome.stderr
    assert outcome.stderr == ""
    rows = (out / "s.csv").read_text().splitlines()
    assert rows[0].startswith("trace,model,num_blocks,kv_memory,pool_bytes,policy,admission,"
                              "status,min_num_blocks,hit_rate,")
    assert rows[1].startswith("aba,tiny-hybrid,2,,4096,latest,fcfs,too small,6,,")
    assert rows[2].startswith("aba,tiny-hybrid,200,,409600,latest,fcfs,ok,,")
    assert len(rows) == 3
    cells = json.loads((out / "s.json").read_text())["cells"]
    assert [(c["num_blocks"], c["status"], c["min_num_blocks"], c["hit_rate"] is None)
            for c in cells] == [(2, "too small", 6, True), (200, "ok", None, False)]
    assert (out / "s.png").stat().st_size > 0
    table = outcome.stdout
    assert "too small" in table and "needs ≥ 6" in table
    assert "2 cells: 2 computed, 0 resumed, 1 too small" in table
    single = run_cli(_argv([*REPLAY, "--num-blocks", "2"], inputs, out), capsys)
    assert_clean_failure(single, 2, "raise --num-blocks (or --kv-memory) to at least 6")


def test_sweep_of_only_too_small_pools_exits_0(inputs: Path, out: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    outcome = run_cli(_argv([*SWEEP, "--num-blocks", "2,3"], inputs, out), capsys)
    assert outcome.code == 0, outcome.stderr
    rows = (out / "s.csv").read_text().splitlines()[1:]
    assert [row.split(",")[7:9] for row in rows] == [["too small", "6"]] * 2
    assert outcome.stdout.count("too small") >= 2


def test_sweep_prints_its_table(inputs: Path, out: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    outcome = run_cli(_argv([*SWEEP, "--policy", "dense,latest", "--num-blocks", "100,200"],
                            inputs, out), capsys)
    assert outcome.code == 0, outcome.stderr
    table = outcome.stdout
    assert "aba on tiny-hybrid" in table and "200" in table and "ceiling" in table
    assert "dense" in table and "latest" in table and "%" in table


@pytest.mark.parametrize("command", ["check-trace", "replay"])
def test_closed_stdout_is_one_line_exit_2(command: str, inputs: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Started with ``>&-`` (Python then has ``sys.stdout = None``): the report would go
    nowhere and the exit status say 0."""
    argv = {"check-trace": ["check-trace", f"{inputs}/good.jsonl"], "replay": REPLAY}[command]
    monkeypatch.setattr("sys.stdout", None)
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"hybridkv {command}: error: stdout='closed' is invalid"), err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = run_cli(["--version"], capsys)
    assert outcome.code == 0
    assert outcome.stdout.startswith("hybridkv ") and outcome.stdout.strip() != "hybridkv"


def test_verify_hint_names_the_checkout_command(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv.cli import app as cli

    def no_engine(sub: object) -> None:
        parser = sub.add_parser("verify")  # type: ignore[attr-defined]
        parser.set_defaults(engine_missing=True)

    monkeypatch.setattr(cli, "_add_verify_parser", no_engine)
    outcome = run_cli(["verify"], capsys)
    assert_clean_failure(outcome, 2, "pip install -e '.[engine]'")
    assert outcome.stdout == ""


def test_readme_has_no_placeholder_paths() -> None:
    readme = (SRC.parent / "README.md").read_text()
    assert "--trace TRACE" not in readme and " TRACE " not in readme


# ---------------------------------------------------------------- signals (subprocess)
LONG_REPLAY = ["replay", "--workload", "agentic", "--policy", "latest,dense", "--quiet",
               "--paranoid", "--set", "num_sessions=32", "--set", "num_turns=8"]
"""Built in a moment, replays for minutes (every invariant checked after every step): the
signal probes interrupt it."""

@needs_proc
@pytest.mark.parametrize("command", [
    pytest.param([*LONG_REPLAY, "--json", "r.json", "--plot", "r.png"], id="replay"),
    pytest.param(["sweep", "--workload", "agentic", "--policy", "latest,dense", "--quiet",
                  "--set", "num_sessions=32", "--set", "num_turns=20", "--num-blocks",
                  "5000,9000", "--csv", "s.csv", "--plot", "s.png"], id="sweep"),
])
def test_ctrl_c_is_one_line_and_exit_130(command: list[str], tmp_path: Path) -> None:
    process = _spawn(command, tmp_path)
    _wait_busy(process, 2.5)  # past the imports and into the replay
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines() == [
        f"hybridkv {command[0]}: interrupted (Ctrl-C); no output written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@needs_proc
def test_sigterm_stops_jobs_workers_at_once(tmp_path: Path) -> None:
    process = _spawn([*LONG_REPLAY, "--jobs", "2", "--json", "r.json"], tmp_path)
    assert _wait_for(lambda: len(_children(process.pid)) >= 2, 30), process.communicate()
    workers = _children(process.pid)
    time.sleep(0.5)
    process.terminate()
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines() == [
        "hybridkv replay: terminated (SIGTERM); no output written"]
    assert _wait_for(lambda: not any(_alive(w) for w in workers), 5), "workers still run"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@needs_proc
def test_killed_parent_takes_its_workers_along(tmp_path: Path) -> None:
    """SIGKILL gives the parent no chance to clean up: the workers' parent-death signal
    (PR_SET_PDEATHSIG) must stop them."""
    process = _spawn([*LONG_REPLAY, "--jobs", "2"], tmp_path)
    assert _wait_for(lambda: len(_children(process.pid)) >= 2, 30), process.communicate()
    workers = _children(process.pid)
    process.kill()
    process.communicate(timeout=30)
    assert _wait_for(lambda: not any(_alive(w) for w in workers), 5), "orphaned workers"


@needs_proc
def test_ctrl_c_in_check_trace(tmp_path: Path) -> None:
    """check-trace on a trace too large to finish quickly (native, 200k requests)."""
    trace = tmp_path / "big.jsonl"
    line = json.dumps({"block_ids": list(range(64)), "block_size": 16, "output_length": 1})
    trace.write_text((line + "\n") * 200_000)
    process = _spawn(["check-trace", str(trace)], tmp_path)
    _wait_busy(process, 1.5)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines() == [
        "hybridkv check-trace: interrupted (Ctrl-C); no output written"]


def test_zlib_error_is_what_a_broken_deflate_raises() -> None:
    """The corrupt-deflate probe file really exercises ``zlib.error`` (not just a bad
    header), so the loader's catch of it is tested."""
    data = _corrupt_deflate()
    with pytest.raises(zlib.error):
        gzip.decompress(data)
