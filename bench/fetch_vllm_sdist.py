"""Fetch vLLM 0.33.0's source distribution (it ships vLLM's ``tests/``) and check its hash.

``pip download --no-binary=:all: vllm==0.33.0`` tries to build the sdist (CUDA, cmake) and
fails, so this asks the index pip itself uses (pip's own HTTP session: its proxy,
certificates and timeouts) for the file and downloads exactly that file.

    python bench/fetch_vllm_sdist.py DEST_DIR     # -> DEST_DIR/vllm-0.33.0.tar.gz

Bad input or a hash mismatch: one line on stderr, exit 2. The file is never committed.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

SDIST_NAME = "vllm-0.33.0.tar.gz"
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
INDEX_URL = "https://pypi.org/simple/vllm/"


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(dest_dir: Path) -> Path:
    """Download the sdist into ``dest_dir`` (kept if present with the right hash)."""
    target = dest_dir / SDIST_NAME
    if target.exists() and sha256_of(target) == SDIST_SHA256:
        return target
    from pip._internal.network.session import PipSession

    session = PipSession()
    listing = session.get(INDEX_URL,
                          headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    listing.raise_for_status()
    urls = [f["url"] for f in listing.json()["files"] if f["filename"] == SDIST_NAME]
    if not urls:
        raise SystemExit(f"error: {INDEX_URL} lists no {SDIST_NAME}")
    partial = target.with_suffix(".part")
    with session.get(urls[0], stream=True) as response:
        response.raise_for_status()
        with partial.open("wb") as handle:
            for chunk in response.iter_content(1 << 20):
                handle.write(chunk)
    got = sha256_of(partial)
    if got != SDIST_SHA256:
        partial.unlink()
        print(f"error: {SDIST_NAME} has sha256 {got}, expected {SDIST_SHA256}",
              file=sys.stderr)
        raise SystemExit(2)
    partial.replace(target)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: fetch_vllm_sdist.py DEST_DIR", file=sys.stderr)
        return 2
    dest = Path(argv[0])
    dest.mkdir(parents=True, exist_ok=True)
    print(fetch(dest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
