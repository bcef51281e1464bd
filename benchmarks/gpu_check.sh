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

OUT="${1:?usage: benchmarks/gpu_check.sh OUTDIR | --fetch-deps}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1

DEPS="$PWD/.gpudeps/root"
mkdir -p "$DEPS"
for deb in .gpudeps/*.deb; do dpkg -x "$deb" "$DEPS"; done
export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"

PY=python3
# No GPU visible here is a failure of the check, not a skip.
$PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no GPU")'
# The CUDA compiler, named: a missing nvcc on PATH must not silently give a CPU-only build.
NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
[[ -x "$NVCC" ]] || { echo "gpu_check: no nvcc (PATH or /usr/local/cuda/bin)" >&2; exit 1; }
TORCH_CMAKE=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')
NCCL_HOME=$($PY -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])')
NCCL_LIB=$(ls "$NCCL_HOME"/lib/libnccl.so* | head -n1)
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cxx11abi", torch._C._GLIBCXX_USE_CXX11_ABI, torch.cuda.get_device_name(0))'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true

cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_CMAKE;$DEPS/usr;$DEPS/usr/lib/x86_64-linux-gnu/cmake;$DEPS/usr/share/cmake" \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES=90 -DSTEPGUARD_WITH_METRICS=OFF \
  -DSTEPGUARD_CUDART=shared \
  -DNCCL_INCLUDE_DIR="$NCCL_HOME/include" -DNCCL_LIBRARY="$NCCL_LIB" | tee "$OUT/configure.log"
grep -q 'stepguard: CUDA' "$OUT/configure.log" ||
  { echo "gpu_check: the configure step found no CUDA/NCCL: this would be a CPU-only build" >&2; exit 1; }
# The C++ ABI flag of the build must be torch's (a mismatch links but fails at run time).
TORCH_ABI=$($PY -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
grep -q "_GLIBCXX_USE_CXX11_ABI=$TORCH_ABI" build-gpu/CMakeCache.txt ||
  { echo "gpu_check: the build's _GLIBCXX_USE_CXX11_ABI is not torch's ($TORCH_ABI)" >&2; exit 1; }
cmake --build build-gpu -j16 --target stepguard_tests bench_inspect_gpu bench_step

set +e
build-gpu/bin/stepguard_tests --gtest_filter='Cuda*:Nccl*:Inspect*' \
  --gtest_output="xml:$OUT/gpu_tests.xml"
tests_rc=$?
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
echo "gpu_check: tests rc=$tests_rc bench_inspect_gpu rc=$bench_rc bench_step rc=$step_rc; results in $OUT"
exit $(( tests_rc != 0 || bench_rc != 0 || step_rc != 0 ))
