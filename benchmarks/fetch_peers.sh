#!/usr/bin/env bash
# Copy vLLM's Triton unified attention kernel (and the one helper module it imports) and its
# FlashAttention 3 library (xz-packed: 170 MB -> 12 MB) out of the vLLM wheel of the version
# benchmarks/vllm_peer.py names (VLLM_VERSION, the release users install) into .peers/
# (git-ignored: vLLM code is never committed). benchmarks/vllm_peer.py and benchmarks/fa3_peer.py
# load them from there; carry .peers/ to a machine without registry access.
#
#   benchmarks/fetch_peers.sh            # downloads the wheel with pip (no dependencies)
#   WHEEL=/path/to/vllm-0.34.0-*.whl benchmarks/fetch_peers.sh   # or uses one you have
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
VERSION=$(sed -n 's/^VLLM_VERSION = "\(.*\)"$/\1/p' benchmarks/vllm_peer.py)
: "${VERSION:?no VLLM_VERSION in benchmarks/vllm_peer.py}"
DEST=.peers/vllm-$VERSION

wheel=${WHEEL:-}
if [ -z "$wheel" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m pip download "vllm==$VERSION" --no-deps --only-binary=:all: -d "$tmp" -q
    wheel=$(ls "$tmp"/vllm-"$VERSION"-*.whl)
fi

"$PYTHON" - "$wheel" "$DEST" <<'PY'
import lzma
import pathlib
import shutil
import sys
import zipfile

wheel, dest = sys.argv[1], pathlib.Path(sys.argv[2])
files = [
    "vllm/v1/attention/ops/triton_attention_helpers.py",
    "vllm/v1/attention/ops/triton_unified_attention.py",
]
with zipfile.ZipFile(wheel) as archive:
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(archive.read(name))
        print(f"{target} ({target.stat().st_size} bytes) from {pathlib.Path(wheel).name}")
    library = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
    packed = dest / f"{library}.xz"
    packed.parent.mkdir(parents=True, exist_ok=True)
    with archive.open(library) as source, lzma.open(packed, "wb", preset=6) as target:
        shutil.copyfileobj(source, target)
    print(f"{packed} ({packed.stat().st_size} bytes) from {pathlib.Path(wheel).name}")
PY
