#!/usr/bin/env bash
# The prepared GPU check (issue: CUDA path). Run on a machine with an NVIDIA GPU, from the
# repository root, with torch (a CUDA build), ray and nixl installed:
#     bash microbenchmarks/gpu_check.sh [OUT_DIR]
# It runs the `gpu` tests, then the benchmark workloads on CUDA tensors (ours against Ray's
# built-in nixl with and without its pool, two actors on one GPU), then the weight-sync
# benchmark on one GPU, and writes JSON results.
# Budget: under 10 minutes on one H100/H200 (at most 200 s of tests, 240 s of benchmark,
# 150 s of weight sync; on an H200: 84 s, about 150 s and 105 s).
set -uo pipefail
out=${1:-gpu-results}
mkdir -p "$out"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
$py -c "import torch, ray, nixl; print(torch.__version__, torch.version.cuda, ray.__version__)" \
  >> "$out/gpu.txt" 2>&1
timeout 200 $py -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu/test_cuda.py --junitxml="$out/gpu-tests.xml" \
  2>&1 | tee "$out/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 240 $py -m microbenchmarks.bench_gpu --device cuda --reps 4 --json "$out/bench-gpu.json" \
  2>&1 | tee "$out/bench-gpu.log"
bench_rc=${PIPESTATUS[0]}
timeout 150 $py -m microbenchmarks.bench_gpu_weights --syncs 5 --json "$out/bench-gpu-weights.json" \
  2>&1 | tee "$out/bench-gpu-weights.log"
weights_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc bench rc=$bench_rc weights bench rc=$weights_rc; results in $out/"
exit $(( tests_rc != 0 || bench_rc != 0 || weights_rc != 0 ))
