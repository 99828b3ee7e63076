#!/usr/bin/env bash
# One run on the H200 (python3 3.12 + torch/CUDA 13 image, no registry): build the CUDA
# extension for this GPU's arch (every kernel family compiled for it: the portable mma.sync
# family, sm_90 code on an H200), run the GPU tests (cuda and triton) and the demo, the quick benchmark (it
# holds the drafter acceptance shape and the windowed drafter, window 4k over a 128k context), and
# compute-sanitizer memcheck and racecheck on a few cuda cases.
#   scripts/gpu_check.sh RESULTS_DIR
# Needs .whl/nvidia_cutlass-4.2.0.0-*.whl (benchmarks/fetch_gpu_wheels.sh; carry ".whl").
# Each step has its own time limit, cut to what is left of an 8-minute budget; a failed step is
# recorded in RESULTS_DIR/summary.txt and the next one still runs. With GPU_CHECK_TARBALL=PATH
# the results folder is also packed into one file there after every step (the device tool
# returns few files). Also runs the split-KV sweep (benchmarks/cuda_splits.py).
# The CUTLASS-DSL families (opt-in, NEVER RUN ON HARDWARE before such a run): the GPU image has no
# nvidia-cutlass-dsl, so their libraries are built ahead of time on the CPU machine and carried
# (.dsl/ is git-ignored, as carry needs):
#   python -m dsl.build --family wgmma --out .dsl/wgmma     # 1-2 min
#   python -m dsl.build --family tcgen05 --out .dsl/tcgen05 # ~3 min on 2 cores
# (carry ".dsl"; GPU_CHECK_DSL_DIR names another folder). On cc 9.0 the CUDA GPU tests run again
# with FP8NCA_BACKEND=wgmma plus the family's own GPU tests, on cc 10.x with tcgen05; any
# other GPU prints "<family>: skipped, needs an sm_XX GPU".
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:?usage: scripts/gpu_check.sh RESULTS_DIR}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1
export PATH="$PATH:/usr/local/cuda/bin"  # compute-sanitizer, cuobjdump

BUDGET_S=${GPU_CHECK_BUDGET_S:-470}  # the whole run, under 8 minutes

pack() {
  if [ -n "${GPU_CHECK_TARBALL:-}" ]; then
    tar czf "$GPU_CHECK_TARBALL" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
  fi
}

step() {  # step NAME SECONDS COMMAND... ; output to RESULTS/NAME.log, cut at the budget
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped, ${left} s of the budget left" | tee -a "$SUMMARY"
    return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s (limit $limit s)" | tee -a "$SUMMARY"
  tail -n 5 "$RESULTS/$name.log"
  pack
  return $rc
}

{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  nvcc --version | tail -n 1
} >"$RESULTS/environment.txt" 2>&1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/nvidia_cutlass-*.whl || { echo "no cutlass wheel" | tee -a "$SUMMARY"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '.')
ARCH=${ARCH/#100/100f}  # the sm_100 family build (B200 and B300)
ARCH=${ARCH/#103/100f}
step build 240 env FP8NCA_BUILD_CUDA=1 FP8NCA_CUDA_ARCHS="$ARCH" FP8NCA_BUILD_JOBS="$(nproc)" \
  python3 setup.py build_ext --inplace || exit 1
cp build/cmake/ptxas.log "$RESULTS/ptxas.log" 2>/dev/null
cuobjdump -res-usage fp8_noncausal_attn/_C*.so >"$RESULTS/res_usage.txt" 2>&1

# Most important first: a step cut by the budget loses the least.
# The GPU-only tests plus the Triton and API tests, which run compiled here (interpreted on CPU);
# first every shipped mma.sync kernel and Triton variant against the reference (most of its
# time Triton's compiles, one per variant).
step pytest_gpu 300 python3 -m pytest -q tests/test_gpu_matrix.py tests/test_cuda_gpu.py \
  tests/test_triton_attention.py tests/test_triton_cache.py tests/test_api.py \
  --junitxml="$RESULTS/pytest_gpu.xml"

# The DSL families on their own GPU (a deadlock in a never-run kernel ends at the step's limit).
DSL_DIR=$(cd "${GPU_CHECK_DSL_DIR:-.dsl}" 2>/dev/null && pwd)
export FP8NCA_DSL_LIBRARY_DIR="$DSL_DIR/wgmma:$DSL_DIR/tcgen05"
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1)
for family in wgmma tcgen05; do
  case "$family:$CAP" in
    wgmma:9.0 | tcgen05:10.*) ;;
    wgmma:*) echo "wgmma: skipped, needs an sm_90 GPU (this one is cc $CAP)" | tee -a "$SUMMARY"; continue ;;
    tcgen05:*) echo "tcgen05: skipped, needs an sm_100 GPU (this one is cc $CAP)" | tee -a "$SUMMARY"; continue ;;
  esac
  if [ ! -f "$DSL_DIR/$family/libfp8nca_$family.so" ]; then
    echo "$family: skipped, no library at ${GPU_CHECK_DSL_DIR:-.dsl}/$family (build it, see the header)" \
      | tee -a "$SUMMARY"
    continue
  fi
  step "pytest_$family" 150 env FP8NCA_BACKEND="$family" python3 -m pytest -q \
    tests/test_dsl_families.py tests/test_cuda_gpu.py -m gpu --junitxml="$RESULTS/pytest_$family.xml"
done
step demo 60 python3 -m fp8_noncausal_attn
step benchmark 180 python3 -m benchmarks.attention --quick --out "$RESULTS/benchmark"
step cuda_splits 90 python3 -m benchmarks.cuda_splits "$RESULTS"
step memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m benchmarks.cuda_memcheck
# Shared-memory hazards: the cp.async stage ring and the key-group merge.
step racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 3 \
  python3 -m benchmarks.cuda_memcheck
pack
cat "$SUMMARY"
