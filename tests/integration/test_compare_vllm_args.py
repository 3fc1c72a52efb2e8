"""``bench/compare_vllm.py`` argument handling (not its vLLM run): bad input is one line on
stderr naming the option, exit 2, checked before vLLM is imported (so these run without
vLLM installed); it used to reach ``import vllm`` first and, with vLLM, end in a traceback
(``--set foo``, ``--num-blocks -5``) or ignore an option (``--limit`` with ``--workload``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "compare_vllm.py"
BASE = ["--model", "gemma3-bench", "--workload", "agentic"]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compare_vllm", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("argv", "fragment"), [
    ([*BASE, "--num-blocks", "-5"], "argument --num-blocks: must be an integer >= 1"),
    ([*BASE, "--num-blocks", "100", "--max-running", "0"], "argument --max-running"),
    ([*BASE, "--num-blocks", "100", "--set", "foo"], "--set='foo' is invalid"),
    ([*BASE, "--num-blocks", "100", "--limit", "3"], "--limit=3 is invalid: applies to"),
    ([*BASE, "--num-blocks", "100", "--policy", "lastest"], "policy='lastest' is invalid"),
    ([*BASE, "--kv-memory", "lots"], "--kv-memory='lots' is invalid"),
    ([*BASE, "--num-blocks", "100", "--check-kv-memory", "1GiB,zz"],
     "--check-kv-memory='zz' is invalid"),
    ([*BASE, "--num-blocks", "100", "--json", "{tmp}"], "names a directory"),
    (["--model", "no-such-model", "--check-kv-memory", "1GiB"], "model='no-such-model'"),
    (["--model", "gemma3-bench", "--trace", "{tmp}/missing.jsonl", "--num-blocks", "9"],
     "does not exist"),
])
def test_bad_input_is_one_line_exit_2_before_vllm(
        argv: list[str], fragment: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = _bench().main(argv)
    except SystemExit as exit_info:  # argparse's own refusals
        code = exit_info.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err
    assert len(err.splitlines()) == 1 and fragment in err, err
    assert "vLLM is not importable" not in err
