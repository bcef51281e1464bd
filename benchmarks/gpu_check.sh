#!/usr/bin/env bash
# The GPU check: builds stepguard against the GPU machine's CUDA LibTorch, runs the GPU tests and
# the GPU benchmarks (the inspection kernel, and a guarded training iteration against the plain
# one: bench_step --device cuda), and writes everything into the folder named by its argument.
#
#   benchmarks/gpu_check.sh --fetch-deps   # on the build machine (Debian, with apt): downloads the
#                                          # .debs the GPU machine lacks into .gpudeps/
#   benchmarks/gpu_check.sh OUTDIR         # on the GPU machine, from the repo root
#
# The GPU machine has CMake, ninja, nvcc and a CUDA LibTorch in its Python, but no yaml-cpp,
# GoogleTest, Google Benchmark, nlohmann-json or xxhash and no package registry: the .debs travel with the
# tree and are unpacked (dpkg -x) into .gpudeps/root. NCCL comes from the nvidia-nccl wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBS=(libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian libyaml-cpp-dev
      libyaml-cpp0.7 nlohmann-json3-dev libxxhash-dev libxxhash0)

if [[ "${1:-}" == "--fetch-deps" ]]; then
  mkdir -p .gpudeps
  grep -qx '/.gpudeps/' .git/info/exclude 2>/dev/null || echo '/.gpudeps/' >> .git/info/exclude
  (cd .gpudeps && apt-get download "${DEBS[@]}")
  ls -l .gpudeps
  exit 0
fi

# --compile-only OUTDIR: the same configuration and build on a machine without a GPU (the build
# machine, with .venv's torch CUDA 13 wheel and nvcc 13), so the first GPU run cannot fail
# on compile errors. Uses the system's packages instead of .gpudeps.
MODE=run
if [[ "${1:-}" == "--compile-only" ]]; then
  MODE=compile-only
  shift
fi
OUT="${1:?usage: benchmarks/gpu_check.sh OUTDIR | --compile-only OUTDIR | --fetch-deps}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/gpu_check.log") 2>&1

DEPS="$PWD/.gpudeps/root"
mkdir -p "$DEPS"
for deb in .gpudeps/*.deb; do [[ -e "$deb" ]] && dpkg -x "$deb" "$DEPS"; done
export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"

PY=${STEPGUARD_PYTHON:-python3}
# sm_90 only (H200): also the architectures a CUDA LibTorch's config adds to the old FindCUDA flags.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
JOBS=16
if [[ "$MODE" == compile-only ]]; then
  PY=${STEPGUARD_PYTHON:-$PWD/.venv/bin/python}
  JOBS=2
else
  # No GPU visible here is a failure of the check, not a skip.
  $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no GPU")'
fi
# The CUDA compiler, named: a missing nvcc on PATH must not silently give a CPU-only build.
NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
[[ -x "$NVCC" ]] || { echo "gpu_check: no nvcc (PATH or /usr/local/cuda/bin)" >&2; exit 1; }
TORCH_CMAKE=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')
NCCL_HOME=$($PY -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])')
NCCL_LIB=$(ls "$NCCL_HOME"/lib/libnccl.so* | head -n1)
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cxx11abi", torch._C._GLIBCXX_USE_CXX11_ABI, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true

cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_CMAKE;$DEPS/usr;$DEPS/usr/lib/x86_64-linux-gnu/cmake;$DEPS/usr/share/cmake" \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES=90 -DSTEPGUARD_WITH_METRICS=OFF \
  -DSTEPGUARD_CUDART=shared -DSTEPGUARD_PYTHON="$(command -v "$PY")" \
  -DNCCL_INCLUDE_DIR="$NCCL_HOME/include" -DNCCL_LIBRARY="$NCCL_LIB" | tee "$OUT/configure.log"
grep -q 'stepguard: kernel path: CPU and CUDA' "$OUT/configure.log" ||
  { echo "gpu_check: the configure step found no CUDA/NCCL: this would be a CPU-only build" >&2; exit 1; }
# The C++ ABI flag of the build must be torch's (a mismatch links but fails at run time). torch
# 2.7 and later build with libstdc++'s default (1) and export no flag.
TORCH_ABI=$($PY -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
BUILD_ABI=1
grep -q "_GLIBCXX_USE_CXX11_ABI=0" build-gpu/CMakeCache.txt && BUILD_ABI=0
[[ "$BUILD_ABI" == "$TORCH_ABI" ]] ||
  { echo "gpu_check: the build's _GLIBCXX_USE_CXX11_ABI ($BUILD_ABI) is not torch's ($TORCH_ABI)" >&2; exit 1; }
TARGETS=(stepguard_tests bench_inspect_gpu bench_step)
grep -q 'stepguard: Python package for torch' "$OUT/configure.log" && TARGETS+=(stepguard_python)
cmake --build build-gpu -j"$JOBS" --target "${TARGETS[@]}"
if [[ "$MODE" == compile-only ]]; then
  echo "gpu_check: compiled ${TARGETS[*]} for the GPU configuration (no GPU run)"
  exit 0
fi

set +e
build-gpu/bin/stepguard_tests --gtest_filter='Cuda*:Nccl*:Inspect*' \
  --gtest_output="xml:$OUT/gpu_tests.xml"
tests_rc=$?
# The Python package on the GPU: model, batch and guard on cuda:0, bf16 autocast (pytest is not on
# the GPU machine: the test file runs as a script through a tiny runner when pytest is missing).
py_rc=0
if [[ " ${TARGETS[*]} " == *" stepguard_python "* ]]; then
  PYTHONPATH="$PWD/build-gpu/python:$PWD/tests/python" $PY -c '
import sys
try:
    import pytest
except ImportError:
    import test_cuda
    test_cuda.test_bf16_autocast_on_cuda_skips_a_nan_and_rolls_back_a_spike()
    test_cuda.test_the_deferred_verdict_makes_no_host_read_in_a_steady_state_step_on_cuda()
    test_cuda.test_the_synchronous_verdict_makes_one_host_read_per_step_on_cuda()
    test_cuda.test_the_deferred_clip_from_the_agreed_norm_makes_no_host_read_on_cuda()
    print("test_cuda: passed (without pytest)")
    sys.exit(0)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "tests/python/test_cuda.py",
                      "tests/python/test_step_api.py"]))'
  py_rc=$?
else
  echo "gpu_check: stepguard_python was not built (no Python headers?); Python GPU test not run"
  py_rc=1
fi
build-gpu/bin/bench_inspect_gpu --benchmark_format=json --benchmark_out="$OUT/bench_gpu.json" \
  --benchmark_out_format=json
bench_rc=$?
# The demo model and the 57M one at a batch a GPU trains (32 x 128 tokens), default policy and no
# snapshots; one JSON object per case. The corpus: the demo's, else this repository's docs.
CORPUS=/usr/share/common-licenses
[[ -d "$CORPUS" ]] || CORPUS="$PWD/docs"
build-gpu/bin/bench_step --device cuda --large-batch 32 --large-block 25 --rounds 4 \
  --corpus "$CORPUS" > "$OUT/bench_step_gpu.json"
step_rc=$?
cat "$OUT/bench_step_gpu.json"
set -e
echo "gpu_check: tests rc=$tests_rc python rc=$py_rc bench_inspect_gpu rc=$bench_rc bench_step rc=$step_rc; results in $OUT"
exit $(( tests_rc != 0 || py_rc != 0 || bench_rc != 0 || step_rc != 0 ))
