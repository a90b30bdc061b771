#!/usr/bin/env bash
# One-command GPU check: build with CUDA for the local GPU, run the CUDA tests, the CUDA
# attention/swap benchmark and the torch SDPA comparisons (decode, tiled prefill), and write
# OUT_DIR/summary.md.
#   bench/gpu_check.sh OUT_DIR        (PYTHON=... selects the interpreter; default python3)
# Needs nvcc and cmake; the Python parts run only where torch sees a GPU and pybind11 is
# importable. Every step runs under `timeout` so the whole check ends within ~8 minutes.
set -u -o pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
BUILD="$SRC/build/gpu-check"
STAGE="$OUT/stage"
DEADLINE=$(( $(date +%s) + 470 ))
SUMMARY="$OUT/summary.md"

# Seconds left for the next step: min(cap, time to the deadline), at least 1.
budget() {
  local left=$(( DEADLINE - $(date +%s) ))
  [ "$left" -gt "$1" ] && left=$1
  [ "$left" -lt 1 ] && left=1
  echo "$left"
}

note() { echo "$*" | tee -a "$SUMMARY"; }

: > "$SUMMARY"
note "# vpage GPU check"
note ""
note "- GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
note "- nvcc: $(nvcc --version 2>/dev/null | tail -1)"

HAVE_TORCH_CUDA=0
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  HAVE_TORCH_CUDA=1
fi
PYBIND11_DIR=$("$PY" -m pybind11 --cmakedir 2>/dev/null || true)
WITH_PYTHON=OFF
if [ -n "$PYBIND11_DIR" ]; then WITH_PYTHON=ON; fi
note "- torch with CUDA: $HAVE_TORCH_CUDA; Python modules built: $WITH_PYTHON"

start=$(date +%s)
timeout "$(budget 60)" cmake -S "$SRC" -B "$BUILD" -DVPAGE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
  -DVPAGE_BUILD_TESTS=OFF -DVPAGE_BUILD_BENCH=ON -DVPAGE_PYTHON=$WITH_PYTHON \
  -DPython_EXECUTABLE="$(command -v "$PY")" ${PYBIND11_DIR:+-Dpybind11_DIR="$PYBIND11_DIR"} \
  > "$OUT/configure.log" 2>&1
targets=(vpage-bench-cuda-attention)
if [ "$WITH_PYTHON" = ON ]; then targets+=(_cuda _core); fi
timeout "$(budget 240)" cmake --build "$BUILD" -j "$(nproc)" --target "${targets[@]}" > "$OUT/build.log" 2>&1
build_rc=$?
note "- build (native arch, targets ${targets[*]}): rc $build_rc in $(( $(date +%s) - start )) s"

if [ "$WITH_PYTHON" = ON ] && [ "$HAVE_TORCH_CUDA" = 1 ]; then
  rm -rf "$STAGE" && mkdir -p "$STAGE" && cp -r "$SRC/python/vpage" "$STAGE/"
  find "$BUILD/python" -maxdepth 1 -name "_*.so" -exec cp {} "$STAGE/vpage/" \;
  PYTHONPATH="$STAGE" timeout "$(budget 150)" "$PY" -m pytest -q -p no:cacheprovider -m cuda \
    "$SRC/tests/python/test_ops_cuda.py" > "$OUT/pytest.log" 2>&1
  note "- CUDA tests: rc $? — $(tail -1 "$OUT/pytest.log")"
else
  note "- CUDA tests: skipped (needs torch with CUDA and pybind11)"
fi

BENCH="$BUILD/bench/vpage-bench-cuda-attention"
if [ -x "$BENCH" ]; then
  timeout "$(budget 120)" "$BENCH" --batch 1,16,64,256 --context 512,2048,8192,16384 --repeats 10 \
    --format json > "$OUT/attention_bench.json" 2> "$OUT/attention_bench.err"
  timeout "$(budget 90)" "$BENCH" --batch 1,64,256 --context 2048,16384 --repeats 10 --format md \
    > "$OUT/attention_bench.md" 2>> "$OUT/attention_bench.err"
  note ""
  note "## vpage-bench-cuda-attention"
  note ""
  cat "$OUT/attention_bench.md" >> "$SUMMARY"
  note ""
  note "Targets: decode attention >= 0.80 of copy bandwidth at batch >= 64 and context >= 2048;"
  note "swap >= 40 GB/s one way for batched transfers of >= 1 MB blocks. (Full sweep: attention_bench.json.)"
else
  note "- benchmark binary missing (see build.log)"
fi

if [ "$WITH_PYTHON" = ON ] && [ "$HAVE_TORCH_CUDA" = 1 ]; then
  PYTHONPATH="$STAGE" timeout "$(budget 90)" "$PY" "$SRC/bench/bench_attention_cuda.py" --batch 1,16,64 \
    --context 512,2048,8192 --repeats 10 --out "$OUT/sdpa.md" > "$OUT/sdpa.log" 2>&1
  note ""
  note "## Paged decode vs torch SDPA (contiguous K/V)"
  note ""
  if [ -s "$OUT/sdpa.md" ]; then cat "$OUT/sdpa.md" >> "$SUMMARY"; else note "failed: see sdpa.log"; fi

  # Tiled paged prefill (whole causal prompts) vs SDPA flash on contiguous K/V.
  PYTHONPATH="$STAGE" timeout "$(budget 75)" "$PY" "$SRC/bench/bench_attention_cuda.py" --mode prefill \
    --batch 1,16 --context 512,2048,8192 --repeats 10 --out "$OUT/prefill_sdpa.md" > "$OUT/prefill_sdpa.log" 2>&1
  note ""
  note "## Tiled paged prefill vs torch SDPA flash (contiguous K/V, causal prompts)"
  note ""
  if [ -s "$OUT/prefill_sdpa.md" ]; then cat "$OUT/prefill_sdpa.md" >> "$SUMMARY"; else note "failed: see prefill_sdpa.log"; fi
  note ""
  note "Target: SDPA / vpage >= 0.70 (the tiled prefill at least 0.7x the speed of flash attention)."
else
  note ""
  note "- SDPA comparisons (decode, prefill): skipped (needs torch with CUDA and pybind11)"
fi
note ""
note "Total: $(( $(date +%s) - DEADLINE + 470 )) s"
