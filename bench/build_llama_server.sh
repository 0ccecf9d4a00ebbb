#!/usr/bin/env bash
# llama.cpp's own llama-server, llama-bench, llama-cli and llama-perplexity, built once for this CPU from
# the llama.cpp sources the PyPI sdist of llama-cpp-python vendors, into the
# git-ignored .llama-cpp/ (bench/llama_cpp.py and bench/serving.py run them).
# Idempotent: a second run finds the binaries and does nothing. About 5 min
# on 2 cores.
#
#     bench/build_llama_server.sh      # or: make llama-server
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PACKAGE_VERSION=0.3.36
DIR="$ROOT/.llama-cpp"
SRC="$DIR/llama_cpp_python-$PACKAGE_VERSION/vendor/llama.cpp"
BIN="$DIR/bin"
JOBS="${JOBS:-2}"  # the machine's cores

TOOLS=(llama-server llama-bench llama-cli llama-perplexity)
if [[ -x "$BIN/llama-server" && -x "$BIN/llama-bench" && -x "$BIN/llama-cli" \
      && -x "$BIN/llama-perplexity" ]]; then
    echo "llama.cpp: $BIN/llama-server is built"
    exit 0
fi
mkdir -p "$DIR"
if [[ ! -d "$SRC" ]]; then
    # the sdist itself, from the package index: `pip download` would build
    # its build dependencies from source only to read its metadata
    NAME="llama_cpp_python-$PACKAGE_VERSION.tar.gz"
    URL=$(curl -fsSL https://pypi.org/simple/llama-cpp-python/ \
        | grep -o "https://[^\"#]*/$NAME#sha256=[0-9a-f]*" | head -n1)
    curl -fsSL -o "$DIR/$NAME" "${URL%%#*}"
    echo "${URL##*=}  $DIR/$NAME" | sha256sum -c --quiet
    tar xzf "$DIR/$NAME" -C "$DIR"
fi
# On a CPU with AMX, -march=native makes llama.cpp repack Q4_1 weights for
# its AMX kernels, and llama-cpp-python's build of it died on its first
# request there; name the same CPU's instruction sets without AMX instead.
CPU_OPTIONS=(-DGGML_NATIVE=ON)
if grep -qw amx_int8 /proc/cpuinfo; then
    CPU_OPTIONS=(-DGGML_NATIVE=OFF)
    for pair in AVX:avx AVX2:avx2 FMA:fma F16C:f16c BMI2:bmi2 AVX512:avx512f \
                AVX512_VBMI:avx512_vbmi AVX512_VNNI:avx512_vnni AVX512_BF16:avx512_bf16; do
        if grep -qw "${pair#*:}" /proc/cpuinfo; then value=ON; else value=OFF; fi
        CPU_OPTIONS+=("-DGGML_${pair%%:*}=$value")
    done
fi
cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF "${CPU_OPTIONS[@]}"
cmake --build "$DIR/build" -j "$JOBS" --target "${TOOLS[@]}"
mkdir -p "$BIN"
for tool in "${TOOLS[@]}"; do cp "$DIR/build/bin/$tool" "$BIN/"; done
echo "llama.cpp: built $BIN/llama-server"
