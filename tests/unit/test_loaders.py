"""Trace loaders on small files written here: fields, sharing, ordering and error messages."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from hybridkv import TraceFormatError
from hybridkv.traces.loaders import detect_format, dump_native, load_trace
from hybridkv.traces.loaders.ragpulse import COMPONENTS, content_token_range
from hybridkv.traces.trace import FILL_TOKEN_BASE, Trace, TraceRequest, expand_prompt
from hybridkv.traces.workloads import agentic

SHARED_TRACES = Path(__file__).parents[2] / ".." / "shared" / "traces"


def write_lines(path: Path, lines: Sequence[object]) -> Path:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path.write_text(text, encoding="utf-8")
    return path


def assert_names(err: TraceFormatError, path: Path, line: int | None, field: str) -> None:
    message = str(err)
    assert str(path) in message
    assert field in message and err.field == field
    assert err.line == line
    if line is not None:
        assert f"{path}:{line}:" in message


# --- Mooncake ---------------------------------------------------------------------------

MOONCAKE = [
    {"timestamp": 0, "input_length": 1000, "output_length": 4, "hash_ids": [0, 1]},
    {"timestamp": 1500, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]},
    {"timestamp": 3000, "input_length": 512, "output_length": 1, "hash_ids": [3]},
]


def test_mooncake_fields_and_expansion(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "mc.jsonl", [*MOONCAKE[:2], "", MOONCAKE[2]])
    trace = load_trace(path)
    assert trace.format == "mooncake" and trace.name == "mc" and len(trace) == 3
    first, second, _ = trace.requests
    assert (first.input_length, first.output_length, first.block_ids) == (1000, 4, (0, 1))
    assert first.trace_block_size == 512 and first.session_id is None
    assert second.arrival_seconds == 1.5
    a, b = expand_prompt(first, 0), expand_prompt(second, 1)
    assert a[:512] == b[:512] == list(range(512))  # shared block 0
    assert a[512] == 512 and b[512] == 2 * 512      # blocks 1 and 2 differ
    assert len(b) == 600 and b[-1] == 2 * 512 + 87
    assert load_trace(path, limit=2).requests == trace.requests[:2]


def test_a_byte_order_mark_is_not_content(tmp_path: Path) -> None:
    """Windows editors start a file with U+FEFF; it read as ``invalid JSON: Unexpected
    UTF-8 BOM (decode using utf-8-sig)`` (JSONL) or the same for a WEKA conversation."""
    plain = write_lines(tmp_path / "plain.jsonl", MOONCAKE)
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert load_trace(marked).requests == load_trace(plain).requests
    conversation = weka_file(tmp_path / "trace_0001.json.gz", [weka_request(0.0, 100, [1])])
    bare = json.loads(gzip.decompress(conversation.read_bytes()))
    marked_weka = tmp_path / "trace_0002.json"
    marked_weka.write_bytes(b"\xef\xbb\xbf" + json.dumps(bare).encode())
    assert [r.input_length for r in load_trace(marked_weka).requests] == [100]


@pytest.mark.parametrize(
    ("bad_line", "field"),
    [
        ({"timestamp": 0, "output_length": 1, "hash_ids": [0]}, "input_length"),
        ({"timestamp": 0, "input_length": "12", "output_length": 1, "hash_ids": [0]},
         "input_length"),
        ({"timestamp": 0, "input_length": 10, "output_length": -3, "hash_ids": [0]},
         "output_length"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0, 1]},
         "hash_ids"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]},
         "hash_ids[0]"),
        ({"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [0]},
         "timestamp"),
        ('{"timestamp": 0, "input_length": 10,', "<json>"),
        ("[1, 2]", "<json>"),
    ],
)
def test_mooncake_errors_name_path_line_and_field(tmp_path: Path, bad_line: object,
                                                  field: str) -> None:
    path = write_lines(tmp_path / "mc.jsonl", [MOONCAKE[0], bad_line])
    with pytest.raises(TraceFormatError) as info:
        load_trace(path, format="mooncake")
    assert_names(info.value, path, 2, field)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    empty = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(TraceFormatError, match="empty"):
        load_trace(empty, format="mooncake")
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(TraceFormatError, match="does not exist") as info:
        load_trace(missing)
    assert_names(info.value, missing, None, "path")


# --- WEKA -------------------------------------------------------------------------------

def weka_file(path: Path, requests: list[dict[str, object]]) -> Path:
    doc = {"id": path.stem, "block_size": 64, "hash_id_scope": "local", "requests": requests}
    with gzip.open(path, "wt", encoding="utf-8") as stream:
        json.dump(doc, stream)
    return path


def weka_request(t: float, num_tokens: int, hash_ids: list[int], out: int = 10,
                 ) -> dict[str, object]:
    return {"t": t, "type": "n", "in": num_tokens, "out": out, "hash_ids": hash_ids,
            "think_time": 0.0, "api_time": 1.0}


def make_weka_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "weka"
    folder.mkdir()
    weka_file(folder / "trace_0001.json.gz", [
        weka_request(0.0, 130, [1, 2]),          # 2 full blocks + 2-token tail
        weka_request(20.0, 200, [1, 2, 3]),
    ])
    weka_file(folder / "trace_0002.json.gz", [
        weka_request(5.0, 64, [1]),              # same local id 1, other conversation
        {"t": 6.0, "type": "subagent", "agent_id": "agent_001",
         "requests": [weka_request(0.0, 128, [1, 7]), weka_request(4.5, 70, [1])]},
        weka_request(8.0, 140, [1, 9]),
    ])
    (folder / "notes.txt").write_text("not a trace")
    return folder


def test_weka_sessions_namespaces_and_global_order(tmp_path: Path) -> None:
    trace = load_trace(make_weka_dir(tmp_path))
    assert trace.format == "weka" and trace.name == "weka"
    order = [(r.request_id, r.arrival_seconds) for r in trace.requests]
    assert order == [
        ("trace_0001:0", 0.0), ("trace_0002:0", 5.0), ("trace_0002/sub0:0", 6.0),
        ("trace_0002:1", 8.0), ("trace_0002/sub0:1", 10.5), ("trace_0001:1", 20.0),
    ]
    by_id = {r.request_id: r for r in trace.requests}
    assert by_id["trace_0002/sub0:0"].session_id == "trace_0002/sub0"
    assert by_id["trace_0001:1"].session_id == "trace_0001"
    # local id 1 means different content in the two files, the same inside one file
    assert by_id["trace_0001:0"].block_ids == (1, 2)
    assert by_id["trace_0002:0"].block_ids == ((1 << 32) | 1,)
    assert by_id["trace_0002/sub0:0"].block_ids[0] == by_id["trace_0002:1"].block_ids[0]
    assert all(r.trace_block_size == 64 for r in trace.requests)
    # the 2-token partial tail has no id: it is filled with request-unique ids
    prompt = expand_prompt(by_id["trace_0001:0"], 0)
    assert prompt[:128] == list(range(64, 192)) and min(prompt[128:]) >= FILL_TOKEN_BASE
    assert [r.request_id for r in load_trace(tmp_path / "weka", limit=2).requests] == [
        "trace_0001:0", "trace_0002:0"]


def test_weka_single_plain_json_file(tmp_path: Path) -> None:
    path = tmp_path / "conv.json"
    path.write_text(json.dumps({"block_size": 64, "requests": [weka_request(0, 64, [5])]}))
    trace = load_trace(path)
    assert trace.format == "weka" and trace.requests[0].request_id == "conv:0"
    assert trace.requests[0].block_ids == (5,)


@pytest.mark.parametrize(
    ("requests", "field"),
    [
        ([weka_request(0, 130, [1])], "requests[0].hash_ids"),
        ([{"t": 0, "out": 1, "hash_ids": []}], "requests[0].in"),
        ([weka_request(0, 64, [1]), {"type": "subagent", "t": 1, "requests": [
            weka_request(0, 64, [1, 2])]}], "requests[1].requests[0].hash_ids"),
        ([weka_request(-1, 64, [1])], "requests[0].t"),
        ([weka_request(0, 64, [1 << 32])], "requests[0].hash_ids"),
    ],
)
def test_weka_errors_name_file_and_field(tmp_path: Path, requests: list[dict[str, object]],
                                         field: str) -> None:
    path = weka_file(tmp_path / "trace_0001.json.gz", requests)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert_names(info.value, path, None, field)


def test_weka_unreadable_and_unsupported_files(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(TraceFormatError, match="cannot be read"):
        load_trace(broken)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{oops")
    with pytest.raises(TraceFormatError, match="invalid JSON"):
        load_trace(bad_json)
    global_scope = tmp_path / "g.json"
    global_scope.write_text(json.dumps({"hash_id_scope": "global", "requests": []}))
    with pytest.raises(TraceFormatError, match="hash_id_scope"):
        load_trace(global_scope)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(TraceFormatError, match="neither"):
        load_trace(empty_dir)
    with pytest.raises(TraceFormatError, match="no"):
        load_trace(empty_dir, format="weka")


# --- RAGPulse ---------------------------------------------------------------------------

LENGTHS = {
    "1_sys_prompt.jsonl": [("sys_prompt_id", 100, 512), ("sys_prompt_id", 101, 40)],
    "2_passages.jsonl": [("passage_id", 0, 30), ("passage_id", 1, 20)],
    "3_history.jsonl": [("history_id", 200, 11)],
    "4_user_input.jsonl": [("user_input_id", 300, 5), ("user_input_id", 301, 6)],
    "5_web_search.jsonl": [("web_search_id", 400, 7)],
}


def ragpulse_line(timestamp: str, session: str, passages: list[int], user: int,
                  extra_tokens: int = 8, **overrides: object) -> dict[str, object]:
    hash_ids = {"sys_prompt": [100, 101], "passages_ids": passages, "history": [200],
                "web_search": [], "user_input": [user]}
    passage_tokens = sum({0: 30, 1: 20}.get(p, 0) for p in passages)
    content = 512 + 40 + 11 + passage_tokens + {300: 5, 301: 6}[user]
    line: dict[str, object] = {"timestamp": timestamp, "input_length": content + extra_tokens,
                               "output_length": 9, "hash_ids": hash_ids, "session_id": session}
    line.update(overrides)
    return line


def make_ragpulse_dir(tmp_path: Path, trace_lines: list[object]) -> Path:
    folder = tmp_path / "ragpulse"
    folder.mkdir()
    for name, rows in LENGTHS.items():
        write_lines(folder / name, [{key: cid, "token_length": n} for key, cid, n in rows])
    write_lines(folder / "0_trace.jsonl", trace_lines)
    return folder


def test_ragpulse_layout_sharing_and_arrival(tmp_path: Path) -> None:
    folder = make_ragpulse_dir(tmp_path, [
        ragpulse_line("82", "s1", [0, 1], 300),
        ragpulse_line("90", "s2", [0], 301),
        ragpulse_line("5", "s1", [1], 300),      # a second sample restarting at 0 s
    ])
    trace = load_trace(folder)
    assert trace.format == "ragpulse" and len(trace) == 3
    first, second, third = trace.requests
    assert first.token_id_ranges[:2] == (content_token_range(1, 100, 512),
                                         content_token_range(1, 101, 40))
    assert first.trace_block_size == 0 and first.token_ids is None
    assert [r.arrival_seconds for r in trace.requests] == [82.0, 90.0, 90.0]
    assert (first.session_id, third.session_id) == ("s1", "s1")
    a, b = expand_prompt(first, 0), expand_prompt(second, 1)
    assert len(a) == first.input_length
    assert a[:582] == b[:582] and a[582] != b[582]   # 512 + 40 sys prompt + passage 0
    assert min(a[-8:]) >= FILL_TOKEN_BASE             # template tokens: request-unique
    # the trace file itself, or a limit, load the same requests
    assert load_trace(folder / "0_trace.jsonl", limit=2).requests == trace.requests[:2]


def test_ragpulse_components_use_disjoint_ids() -> None:
    ranges = [content_token_range(k.kind_id, 5, 512) for k in COMPONENTS]
    starts = sorted(start for start, _ in ranges)
    assert all(end <= nxt for (_, end), nxt in zip(sorted(ranges), starts[1:], strict=False))
    assert max(end for _, end in ranges) < FILL_TOKEN_BASE


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (ragpulse_line("1", "s", [7], 300), "hash_ids.passages_ids"),
        (ragpulse_line("1", "s", [0], 300, extra_tokens=-1), "input_length"),
        (ragpulse_line("soon", "s", [0], 300), "timestamp"),
        (ragpulse_line("1", "", [0], 300), "session_id"),
        (ragpulse_line("1", "s", [0], 300, hash_ids={"sys_prompt": []}), "hash_ids.passages_ids"),
        (ragpulse_line("1", "s", [0], 300, hash_ids={"images": []}), "hash_ids"),
    ],
)
def test_ragpulse_errors_name_line_and_field(tmp_path: Path, line: dict[str, object],
                                             field: str) -> None:
    folder = make_ragpulse_dir(tmp_path, [ragpulse_line("0", "s", [0], 300), line])
    with pytest.raises(TraceFormatError) as info:
        load_trace(folder)
    assert_names(info.value, folder / "0_trace.jsonl", 2, field)


def test_ragpulse_missing_length_file(tmp_path: Path) -> None:
    folder = make_ragpulse_dir(tmp_path, [ragpulse_line("0", "s", [0], 300)])
    (folder / "3_history.jsonl").unlink()
    with pytest.raises(TraceFormatError, match="is missing") as info:
        load_trace(folder)
    assert_names(info.value, folder / "3_history.jsonl", None, "path")


# --- native -----------------------------------------------------------------------------

def test_native_round_trip_keeps_every_field(tmp_path: Path) -> None:
    requests = (
        TraceRequest("blocks", 100, 3, block_ids=(7, 8), trace_block_size=64,
                     session_id="s", arrival_seconds=0.25, phase=1, tag="x"),
        TraceRequest("ranges", 9, 0, token_id_ranges=((10, 15), (40, 42))),
        *agentic(num_sessions=2, num_turns=2, first_prompt_tokens=5, turn_tokens=3,
                 output_tokens=2).requests,
    )
    trace = Trace("mixed", requests)
    path = tmp_path / "t.jsonl"
    dump_native(trace, path)
    loaded = load_trace(path)
    assert loaded.format == "native" and loaded.name == "mixed"
    assert loaded.requests == trace.requests
    assert [expand_prompt(r, i) for i, r in enumerate(loaded.requests)] == [
        expand_prompt(r, i) for i, r in enumerate(trace.requests)]


def test_native_defaults(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "n.jsonl", [
        {"tokens": [1, 2, 3], "output_length": 2},
        {"block_ids": [4], "block_size": 8, "output_length": 1, "input_length": 10},
    ])
    trace = load_trace(path)
    assert trace.name == "n"
    first, second = trace.requests
    assert (first.request_id, first.input_length, first.token_ids) == ("req-0", 3, (1, 2, 3))
    assert expand_prompt(second, 1)[:8] == list(range(32, 40))
    assert len(expand_prompt(second, 1)) == 10


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ({"tokens": [1], "output_lenght": 1}, "output_lenght"),
        ({"tokens": [1], "block_ids": [1], "block_size": 4, "output_length": 1}, "tokens"),
        ({"output_length": 1}, "tokens"),
        ({"tokens": [1]}, "output_length"),
        ({"tokens": [1, "2"], "output_length": 1}, "tokens[1]"),
        ({"tokens": [FILL_TOKEN_BASE], "output_length": 1}, "tokens"),
        ({"block_ids": [1], "output_length": 1}, "block_size"),
        # record checks name the file's keys (they said output_token_ids, input_length)
        ({"tokens": [1], "output_length": 2, "output_tokens": [5]}, "output_tokens"),
        ({"tokens": [], "output_length": 1}, "tokens"),
        ({"block_ids": [], "block_size": 4, "output_length": 1}, "block_ids"),
        ({"token_ranges": [[5, 3]], "output_length": 1}, "token_ranges[0]"),
        ({"tokens": [1], "output_length": 1, "phase": -1}, "phase"),
        ({"hybridkv_trace": 1}, "hybridkv_trace"),
    ],
)
def test_native_errors_name_line_and_field(tmp_path: Path, line: dict[str, object],
                                           field: str) -> None:
    path = write_lines(tmp_path / "n.jsonl", [{"tokens": [1], "output_length": 1}, line])
    with pytest.raises(TraceFormatError) as info:
        load_trace(path, format="native")
    assert_names(info.value, path, 2, field)


def test_native_duplicate_ids_and_bad_version(tmp_path: Path) -> None:
    dup = write_lines(tmp_path / "d.jsonl", [{"id": "a", "tokens": [1], "output_length": 1},
                                             {"id": "a", "tokens": [2], "output_length": 1}])
    with pytest.raises(TraceFormatError, match="'a' repeats"):
        load_trace(dup)
    version = write_lines(tmp_path / "v.jsonl", [{"hybridkv_trace": 2}])
    with pytest.raises(TraceFormatError, match="unsupported version"):
        load_trace(version)


# --- detection --------------------------------------------------------------------------

def test_detection_and_overrides(tmp_path: Path) -> None:
    mooncake = write_lines(tmp_path / "a.jsonl", MOONCAKE)
    assert detect_format(mooncake) == "mooncake"
    unknown = write_lines(tmp_path / "b.jsonl", [{"prompt": "hello"}])
    with pytest.raises(TraceFormatError, match="cannot tell") as info:
        load_trace(unknown)
    assert_names(info.value, unknown, 1, "<format>")
    with pytest.raises(TraceFormatError, match="unknown format"):
        load_trace(mooncake, format="csv")  # type: ignore[arg-type]
    with pytest.raises(TraceFormatError, match="limit"):
        load_trace(mooncake, limit=-1)


# --- excerpts of the real traces (skipped when ../shared/traces is absent) ------------------

def shared(path: str) -> Path:
    full = SHARED_TRACES / path
    if not full.exists():
        pytest.skip(f"{full} not available")
    return full


def test_real_mooncake_excerpt(tmp_path: Path) -> None:
    source = shared("mooncake_synthetic/synthetic_trace.jsonl")
    with source.open(encoding="utf-8") as stream:
        lines = [next(stream).rstrip("\n") for _ in range(20)]
    trace = load_trace(write_lines(tmp_path / "excerpt.jsonl", lines))
    assert len(trace) == 20
    for request in trace.requests:
        assert len(request.block_ids) == -(-request.input_length // 512)
        assert len(expand_prompt(request, 0)) == request.input_length


def test_real_weka_conversation_file() -> None:
    trace = load_trace(shared("weka_cc_agentic/trace_0057.json.gz"))
    assert len(trace) >= 1 and {r.session_id for r in trace.requests} == {"trace_0057"}
    for request in trace.requests:
        assert len(request.block_ids) == request.input_length // 64


def test_real_ragpulse_excerpt(tmp_path: Path) -> None:
    source = shared("ragpulse")
    with (source / "0_trace.jsonl").open(encoding="utf-8") as stream:
        lines = [json.loads(next(stream)) for _ in range(3)]
    needed = {kind.key: {cid for line in lines for cid in line["hash_ids"][kind.key]}
              for kind in COMPONENTS}
    folder = tmp_path / "ragpulse"
    folder.mkdir()
    write_lines(folder / "0_trace.jsonl", lines)
    for kind in COMPONENTS:
        with (source / kind.file_name).open(encoding="utf-8") as stream:
            rows = [json.loads(text) for text in stream if text.strip()]
        write_lines(folder / kind.file_name,
                    [row for row in rows if row[kind.id_field] in needed[kind.key]])
    trace = load_trace(folder)
    assert [r.input_length for r in trace.requests] == [line["input_length"] for line in lines]
    for request in trace.requests:
        assert 6 <= request.input_length - request.num_explicit_tokens <= 12
