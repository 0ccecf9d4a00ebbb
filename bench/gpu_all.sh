#!/usr/bin/env bash
# Everything that needs CUDA, in one go, for a GPU at hand for minutes only:
#   1. the GPU tests: the Triton kernels compiled against their torch twins,
#      and decode forwards replayed from CUDA graphs against eager ones (a
#      failure there is run again under compute-sanitizer, to name the access);
#   2. bench/kernels_gpu.py: paged decode, verification, prefill chunks, KV
#      writes and block copies at the launcher's default choices;
#   3. bench/engine_gpu.py: the engine at 1, 32 and 256 streams, eager and
#      with CUDA graphs, with and without speculation.
# Each step has its own time limit, so one that hangs leaves the others
# their time. Logs and JSON results land in the folder given (default
# bench/results/gpu); the last line printed is a JSON summary.
#
#   bash bench/gpu_all.sh [OUT_DIR] [--quick]
#
# It runs from the checkout as it is (no install). On a machine with no
# network that lacks some of specpage's packages, WHEELS=DIR installs the
# wheels in DIR into a folder of their own first (msgspec is the one a
# GPU image with torch and transformers tends to lack). BEFORE=FILE times an
# earlier paged_decode module beside the current one (kernels_gpu --before).
set -uo pipefail
out=${1:-bench/results/gpu}
quick=${2:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${WHEELS:-}" ]; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:$site"
fi

step() {  # step NAME SECONDS COMMAND...: its output in $out/NAME.log, its status in $status
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - start)) s"
  tail -n 3 "$out/$name.log"
  status="$status\"$name\": $rc, "
}

status=""
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/device.txt"

# at most 570 s in all, under a 600 s call
step tests 150 "$py" -m pytest -q -p no:cacheprovider -x \
  tests/kernels/test_triton.py tests/kernels/test_triton_optional.py \
  tests/engine/test_cuda_graphs.py
modes="" engine_limit=270
if ! grep -q " passed" "$out/tests.log" || grep -q " failed" "$out/tests.log"; then
  step sanitizer 120 compute-sanitizer --tool memcheck --print-limit 20 \
    "$py" -m pytest -q -p no:cacheprovider -x tests/engine/test_cuda_graphs.py -k graph_replays
  modes="--modes off,model_free,draft_and_model_free" engine_limit=150  # no graphs' runs
fi
step kernels 150 "$py" bench/kernels_gpu.py $quick ${BEFORE:+--before "$BEFORE"}
step engine $engine_limit "$py" bench/engine_gpu.py $quick $modes
for name in kernels_gpu engine_gpu; do  # only what this run wrote
  [ bench/results/$name.json -nt "$out/device.txt" ] && cp bench/results/$name.json "$out/"
done
echo "{\"bench\": \"gpu_all\", \"out\": \"$out\", ${status%, }}"
