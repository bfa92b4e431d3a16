#!/usr/bin/env bash
# The install path a pip user takes, checked from outside the repository:
#   1. build a wheel of this checkout (no dependencies) and check what it holds: LICENSE,
#      both sources of the compiled helpers, the bench and cli packages;
#   2. make a fresh venv, install torch (TORCH, default the tested torch==2.13.0: name it
#      first, or pip resolves torch to a CUDA build of several GB), then the wheel;
#   3. build the compiled helpers from the installed package, into a folder of this
#      check (RAY_RDT_POOL_NATIVE_DIR), so that a build cached by a clone does not count;
#   4. run examples/put_get.py, copied out of the repository (two actors, a local Ray, or
#      the cluster RAY_ADDRESS names), and check that every digest sent was received;
#   5. run `ray-rdt-pool doctor` (the console script of the venv).
# Usage: tools/check_wheel.sh [WORK_DIR]   (default /tmp/ray-rdt-pool-wheel-check; it is
# emptied first). `make wheel-check` runs it; `make test` does not (it installs packages).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=${1:-/tmp/ray-rdt-pool-wheel-check}
py=${PY:-python3}
torch_req=${TORCH:-torch==2.13.0}
case "$work" in "$repo"|"$repo"/*) echo "WORK_DIR must be outside $repo" >&2; exit 2;; esac

rm -rf "$work"
mkdir -p "$work"
cd "$work"                    # nothing below may import the checkout
unset PYTHONPATH
export RAY_RDT_POOL_NATIVE_DIR="$work/native"

echo "== wheel of $repo"
"$py" -m pip wheel -q --no-deps -w "$work/whl" "$repo"
whl=$(ls "$work"/whl/ray_rdt_pool-*.whl)
echo "$whl"
"$py" - "$whl" <<'EOF'
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["ray_rdt_pool/memory/native/_copy.c", "ray_rdt_pool/memory/native/_native.cpp",
        "ray_rdt_pool/bench/run.py", "ray_rdt_pool/bench/testbed.py",
        "ray_rdt_pool/cli/doctor.py", "ray_rdt_pool/py.typed"]
missing = [n for n in need if n not in names]
licenses = [n for n in names if n.endswith("/LICENSE") and ".dist-info/" in n]
if not licenses:
    missing.append("*.dist-info/licenses/LICENSE")
built = [n for n in names if n.endswith((".so", ".o"))]
if missing or built:
    sys.exit(f"wheel: missing {missing}, compiled files {built}")
print(f"wheel holds {len(names)} files, among them {', '.join(licenses + need[:3])}")
EOF

echo "== fresh venv: $torch_req, then the wheel"
"$py" -m venv "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install -q "$torch_req"
"$vpy" -m pip install -q "$whl"
"$vpy" - <<EOF
import importlib.metadata, ray_rdt_pool
assert ray_rdt_pool.__file__.startswith("$work/venv/"), ray_rdt_pool.__file__
print("ray-rdt-pool", ray_rdt_pool.__version__, "from", ray_rdt_pool.__file__)
print("ray", importlib.metadata.version("ray"), "torch", importlib.metadata.version("torch"),
      "nixl", importlib.metadata.version("nixl"))
EOF

echo "== the compiled helpers, built from the installed package"
"$vpy" -m ray_rdt_pool.memory.native build --optional
"$vpy" -m ray_rdt_pool.memory.native path

echo "== examples/put_get.py, run from $work"
cp "$repo/examples/put_get.py" "$work/put_get.py"
"$vpy" "$work/put_get.py" | tee "$work/put_get.out"
"$vpy" - "$work/put_get.out" <<'EOF'
import re
import sys

text = open(sys.argv[1]).read()
pairs = re.findall(r"(?:put|returned) ([0-9a-f]{16}), learner got ([0-9a-f]{16})", text)
if len(pairs) != 2 or any(a != b for a, b in pairs):
    sys.exit(f"put_get.py: the learner did not get what the trainer sent: {pairs}")
if "learner received 2 objects over nixl_pool" not in text:
    sys.exit("put_get.py: the learner did not receive both objects over nixl_pool")
print("put_get.py: both digests match")
EOF

echo "== ray-rdt-pool doctor"
"$work/venv/bin/ray-rdt-pool" doctor
echo "== wheel check passed"
