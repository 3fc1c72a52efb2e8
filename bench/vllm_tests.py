"""Run vLLM 0.33.0's own ``tests/v1/core`` with hybridkv's manager inside vLLM's Scheduler.

Run with the interpreter of the vLLM venv (``bash bench/setup_vllm.sh``):

    .venv-vllm/bin/python bench/vllm_tests.py                      # policies latest and
                                                                   # interval:32768+predict
    .venv-vllm/bin/python bench/vllm_tests.py --policy latest
    .venv-vllm/bin/python bench/vllm_tests.py --stock              # the baseline (see below)

Steps: fetch the pinned sdist (``fetch_vllm_sdist.py``, sha256 checked) into ``--work``
(default ``build/vllm-tests``, ignored by git), unpack its ``tests/`` and ``pyproject.toml``
(never its ``vllm/``: it would shadow the installed wheel), write a local
``facebook/opt-125m/config.json`` (the tests name that model; no weights are read), then run
pytest there with ``-p hybridkv.vllm.testing`` on CPU (``VLLM_TARGET_DEVICE=cpu``,
``--noconftest``, offline).

Per policy it runs the test cases of ``bench/vllm_scheduler_tests.txt`` — every case of
``tests/v1/core`` that builds a Scheduler and passes with vLLM's own manager — and fails
(exit 1) unless each of them passes through the facade or is a documented refusal
(``hybridkv/vllm/skiplist.py``), and unless at least ``--min-functions`` test functions pass.
``--stock`` runs all of ``tests/v1/core`` with vLLM's own manager and rewrites that list.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from fetch_vllm_sdist import SDIST_NAME, fetch  # noqa: E402

CASES_FILE = ROOT / "bench" / "vllm_scheduler_tests.txt"
DEFAULT_POLICIES = ("latest", "interval:32768+predict")
OPT_125M_CONFIG = {  # the public OPT-125m config fields ModelConfig reads
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
    "hidden_size": 768, "word_embed_proj_dim": 768, "ffn_dim": 3072,
    "num_hidden_layers": 12, "num_attention_heads": 12, "vocab_size": 50272,
    "max_position_embeddings": 2048, "do_layer_norm_before": True, "enable_bias": True,
    "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "torch_dtype": "float16",
}


def prepare(work: Path) -> Path:
    """The test tree: ``work/t33`` with vLLM's tests and the OPT-125m stand-in config."""
    tree = work / "t33"
    if not (tree / "tests" / "v1" / "core").is_dir():
        sdist = fetch(work)
        prefix = SDIST_NAME.removesuffix(".tar.gz") + "/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers()
                       if m.name.startswith((prefix + "tests/", prefix + "pyproject.toml"))]
            for member in members:
                member.name = member.name.removeprefix(prefix)
            archive.extractall(tree, members=members, filter="data")
    config = tree / "facebook" / "opt-125m" / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(OPT_125M_CONFIG, indent=1))
    return tree


def run_pytest(tree: Path, policy: str, targets: list[str], report: Path) -> None:
    """pytest in ``tree`` through the plug-in; the per-case report lands in ``report``."""
    env = dict(os.environ, HYBRIDKV_VLLM_POLICY=policy, HYBRIDKV_VLLM_REPORT=str(report),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join([str(tree), str(ROOT / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider",
               "-p", "hybridkv.vllm.testing", "-q", "--tb=line", *targets]
    subprocess.run(command, cwd=tree, env=env, check=False,
                   stdout=subprocess.DEVNULL if targets != ["tests/v1/core"] else None)


def check_policy(tree: Path, work: Path, policy: str, min_functions: int) -> bool:
    """Run the Scheduler-driven cases under ``policy``; print the tally; True if accepted."""
    cases = CASES_FILE.read_text().split()
    report = work / f"report-{policy.replace(':', '_').replace('+', '_')}.json"
    run_pytest(tree, policy, cases, report)
    rows = json.loads(report.read_text())
    outcomes = Counter(rows[c][0] if c in rows else "missing" for c in cases)
    bad = [c for c in cases if c not in rows or rows[c][0] not in ("passed", "skipped")]
    functions = {c.split("[", 1)[0] for c in cases}
    failing = {c.split("[", 1)[0] for c in cases if rows.get(c, ["missing"])[0] != "passed"}
    passed_functions = len(functions - failing)
    print(f"policy {policy}: {outcomes['passed']} of {len(cases)} cases passed "
          f"({passed_functions} test functions with every case passing), "
          f"{outcomes['skipped']} skipped (documented refusals), {len(bad)} failed")
    for case in bad:
        print(f"  FAILED {case}: {rows.get(case, ['', '', 'not run'])[2]}")
    return not bad and passed_functions >= min_functions


def stock_baseline(tree: Path, work: Path) -> None:
    """All of ``tests/v1/core`` on vLLM's own manager; rewrite ``CASES_FILE``."""
    report = work / "report-stock.json"
    run_pytest(tree, "vllm", ["tests/v1/core"], report)
    rows = json.loads(report.read_text())
    cases = [c for c, (outcome, built, _) in rows.items() if built and outcome == "passed"]
    outcomes = Counter(outcome for outcome, _, _ in rows.values())
    print(f"stock manager: {len(rows)} cases, {dict(outcomes)}; {len(cases)} build a "
          f"Scheduler and pass ({len({c.split('[', 1)[0] for c in cases})} functions)")
    CASES_FILE.write_text("\n".join(sorted(cases)) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--policy", action="append",
                        help=f"hybridkv policy (repeatable; default {DEFAULT_POLICIES})")
    parser.add_argument("--stock", action="store_true",
                        help="baseline on vLLM's own manager; rewrites the case list")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "vllm-tests")
    parser.add_argument("--min-functions", type=int, default=100,
                        help="fail unless this many test functions pass (default 100)")
    args = parser.parse_args(argv)
    if args.min_functions < 0:
        parser.error("--min-functions must be >= 0")
    args.work.mkdir(parents=True, exist_ok=True)
    tree = prepare(args.work)
    if args.stock:
        stock_baseline(tree, args.work)
        return 0
    results = [check_policy(tree, args.work, policy, args.min_functions)
               for policy in args.policy or DEFAULT_POLICIES]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
