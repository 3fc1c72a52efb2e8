#!/usr/bin/env bash
# Build a separate virtual environment in which vLLM 0.33.0's KV-cache manager is importable on
# a CPU-only machine, with hybridkv installed (editable) beside it, for bench/compare_vllm.py.
#
#   bash bench/setup_vllm.sh [VENV_DIR]        # default: .venv-vllm in the repo root
#   .venv-vllm/bin/python bench/compare_vllm.py --help
#
# vLLM is never a dependency of hybridkv; it lives only in this venv.
#
# How: the vLLM wheel is installed with --no-deps (its full dependency set pins a CUDA torch
# 2.14.0, flashinfer, cutlass, ... — gigabytes the cache manager never touches), then only the
# packages that the import chain of vllm.v1.core.kv_cache_manager / vllm.v1.request actually
# reaches are added (found by iterating on ImportErrors), at the versions vLLM's metadata pins
# where it pins them. torch is the CPU build 2.13.0 (the cache manager uses torch only for
# dtype fields of the KV specs); pip warns that vLLM wants torch==2.14.0 — expected, harmless
# here, as are pip's other "vllm 0.33.0 requires X, which is not installed" lines (GPU
# kernels, serving front-ends, multimodal codecs). No module is stubbed out.
#
# Verified on the 2-core CPU dev machine (Python 3.11, 2026-11-26): a fresh run takes ~2 min;
# the vLLM wheel is 336 MB, torch comes from the local 2.13.0+cpu wheel; the venv is ~3 GB.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)

# 1. torch, CPU build (this machine has the 2.13.0+cpu wheel locally).
"${PIP[@]}" "torch==2.13.0"

# 2. vLLM itself, without its dependency closure.
"${PIP[@]}" --no-deps "vllm==0.33.0"

# 3. What `import vllm.v1.core.kv_cache_manager, vllm.v1.request` needs, pinned as vLLM pins.
"${PIP[@]}" \
    packaging psutil "pyzmq>=25.0.0" urllib3 regex numpy msgspec "pydantic>=2.12.0" cbor2 \
    "transformers>=5.16.1,<5.21.0" "aiohttp>=3.14.4" "requests>=2.33.0" openai-harmony \
    "openai>=2.25.0" "pillow>=13.0.0" pybase64 cachetools cloudpickle uvloop py-cpuinfo \
    "prometheus_client>=0.18.0" "xgrammar==0.2.8" "fastapi>=0.133.0,<0.137.0" \
    partial-json-parser "llguidance>=1.7.0,<1.8.0"

# 3b. What vLLM's Scheduler (vllm.v1.core.sched) and the collection of vLLM 0.33.0's own
#     tests/v1/core need beyond the manager (bench/vllm_tests.sh runs them; found the same
#     way, by iterating on ImportErrors), plus pytest itself. Never `pip install vllm` here:
#     pip would resolve vLLM's whole dependency set (CUDA torch 2.14, flashinfer, ...).
"${PIP[@]}" \
    "pytest>=8" "pytest-asyncio>=0.23" "hypothesis>=6" einops httpx anthropic uvicorn \
    watchfiles orjson

# 4. hybridkv (editable, no deps) and its own runtime dependencies (HYBRIDKV_PURE_PYTHON=1
#    skips compiling the core, as .ci/run does: its step vllm imports the sources).
"${PIP[@]}" --no-deps -e "$ROOT"
"${PIP[@]}" "xxhash>=3.0" "rich>=13" "matplotlib>=3.7"

# 5. Check: the manager, the request and its block hasher import and construct.
"$VENV/bin/python" - <<'EOF'
import vllm
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: F401
from vllm.v1.request import Request  # noqa: F401
import hybridkv
assert vllm.__version__ == "0.33.0", vllm.__version__
print(f"vllm {vllm.__version__} cache manager importable; hybridkv from {hybridkv.__file__}")
EOF
echo "ready: $VENV/bin/python bench/compare_vllm.py --help"
