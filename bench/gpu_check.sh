#!/usr/bin/env bash
# One-command GPU check: build with CUDA for the local GPU, run the CUDA op tests and the
# engine's CUDA tests, the CUDA attention/swap benchmark, tiled prefill against torch SDPA
# flash, decode step time with and without CUDA graphs, end-to-end throughput against
# transformers' generate, the engine's swap bandwidth and paged decode against SDPA, and write
# OUT_DIR/summary.md. Steps run in that order of priority; one that would start with too
# little time left is skipped with the reason, so a slow step costs only the later ones.
#   bench/gpu_check.sh OUT_DIR [STEP...]   (PYTHON=... selects the interpreter; default python3)
# STEPs (default: all): ops engine attention prefill decode throughput swap sdpa. The build
# always runs (incrementally), so a short device lease can split the check over several calls.
# Needs nvcc and cmake; the Python parts run only where torch sees a GPU and pybind11 is
# importable. Every step runs under `timeout` so the whole check ends within ~8 minutes.
set -u -o pipefail

ALL_STEPS="ops engine attention prefill decode throughput swap sdpa"
if [ $# -lt 1 ]; then
  echo "usage: $0 OUT_DIR [STEP...]; steps: $ALL_STEPS" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
shift
STEPS=" ${*:-$ALL_STEPS} "
for step in $STEPS; do
  case " $ALL_STEPS " in *" $step "*) ;; *) echo "unknown step: $step (steps: $ALL_STEPS)" >&2; exit 2;; esac
done
# True when step $1 was asked for.
wants() { [[ "$STEPS" == *" $1 "* ]]; }
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

# True when at least $1 seconds are left before the deadline (else notes that $2 is skipped).
has_time() {
  if [ $(( DEADLINE - $(date +%s) )) -ge "$1" ]; then return 0; fi
  note "- $2: skipped (out of time)"
  return 1
}

# Appends file $2 under heading $1, or says which log to read.
section() {
  note ""
  note "## $1"
  note ""
  if [ -s "$2" ]; then cat "$2" >> "$SUMMARY"; else note "failed: see $3"; fi
}

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

if ! nvidia-smi -L > /dev/null 2>&1; then
  note "- no GPU visible (nvidia-smi -L failed): build, tests and benchmarks skipped"
  exit 0
fi

# Runs on the same code have differed by ~15% in decode attention at equal copy bandwidth, so
# utilization, SM clock, power and temperature are sampled every second while the check runs.
nvidia-smi --query-gpu=utilization.gpu,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
  --format=csv,noheader,nounits \
  -l 1 > "$OUT/clocks.csv" 2>/dev/null &
CLOCKS_PID=$!
trap 'kill $CLOCKS_PID 2>/dev/null' EXIT

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

PYOK=0
if [ "$WITH_PYTHON" = ON ] && [ "$HAVE_TORCH_CUDA" = 1 ] && [ "$build_rc" = 0 ]; then PYOK=1; fi
NOPY="needs torch with CUDA, pybind11 and a successful build"
if [ "$PYOK" = 1 ]; then
  rm -rf "$STAGE" && mkdir -p "$STAGE" && cp -r "$SRC/python/vpage" "$STAGE/"
  find "$BUILD/python" -maxdepth 1 -name "_*.so" -exec cp {} "$STAGE/vpage/" \;
  export PYTHONPATH="$STAGE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1  # keeps packages carried in by the caller
  if wants ops && has_time 30 "CUDA op tests"; then
    timeout "$(budget 110)" "$PY" -m pytest -q -p no:cacheprovider -m cuda \
      "$SRC/tests/python/ops/test_ops_cuda.py" "$SRC/tests/python/ops/test_ops_bitmask.py" \
      "$SRC/tests/python/ops/test_ops_layer_cuda.py" > "$OUT/pytest.log" 2>&1
    note "- CUDA op tests: rc $? — $(tail -1 "$OUT/pytest.log")"
  fi
  # Graphs vs eager, swap preemption, CUDA vs CPU (float32) and memory profiling.
  if wants engine && has_time 30 "engine CUDA tests"; then
    timeout "$(budget 180)" "$PY" -m pytest -q -p no:cacheprovider -m cuda \
      "$SRC/tests/python/worker/test_engine_cuda.py" > "$OUT/pytest_engine.log" 2>&1
    note "- engine CUDA tests: rc $? — $(tail -1 "$OUT/pytest_engine.log")"
  fi
else
  note "- CUDA op and engine tests: skipped ($NOPY)"
fi

BENCH="$BUILD/bench/vpage-bench-cuda-attention"
if ! wants attention; then
  :
elif [ ! -x "$BENCH" ]; then
  note "- benchmark binary missing (see build.log)"
elif has_time 20 "vpage-bench-cuda-attention"; then
  timeout "$(budget 60)" "$BENCH" --batch 1,64,256 --context 2048,16384 --repeats 10 --format md \
    > "$OUT/attention_bench.md" 2> "$OUT/attention_bench.err"
  timeout "$(budget 60)" "$BENCH" --batch 1,16,64,256 --context 512,2048,8192,16384 --repeats 10 \
    --format json > "$OUT/attention_bench.json" 2>> "$OUT/attention_bench.err"
  note ""
  note "## vpage-bench-cuda-attention"
  note ""
  cat "$OUT/attention_bench.md" >> "$SUMMARY"
  note ""
  note "Targets: decode attention >= 0.80 of copy bandwidth at batch >= 64 and context >= 2048;"
  note "swap >= 40 GB/s one way for batched transfers of >= 1 MB blocks. (Full sweep: attention_bench.json.)"
fi

if [ "$PYOK" = 1 ]; then
  # Tiled paged prefill (whole causal prompts) vs SDPA flash on contiguous K/V: the prefill
  # target has no other measurement, so it comes first.
  if wants prefill && has_time 20 "tiled prefill vs torch SDPA flash"; then
    timeout "$(budget 45)" "$PY" "$SRC/bench/bench_attention_cuda.py" --mode prefill \
      --batch 1,16 --context 512,2048,8192 --repeats 10 --out "$OUT/prefill_sdpa.md" > "$OUT/prefill_sdpa.log" 2>&1
    section "Tiled paged prefill vs torch SDPA flash (contiguous K/V, causal prompts)" "$OUT/prefill_sdpa.md" \
      prefill_sdpa.log
    note ""
    note "Target: SDPA / vpage >= 0.70 (the tiled prefill at least 0.7x the speed of flash attention)."
  fi

  if wants decode && has_time 30 "decode step time, CUDA graphs vs eager"; then
    timeout "$(budget 70)" "$PY" "$SRC/bench/bench_decode_cuda.py" --batch 1,8,64 --steps 30 \
      --out "$OUT/decode_graphs.md" > "$OUT/decode_graphs.log" 2>&1
    section "Decode step time: CUDA graphs vs eager (default model)" "$OUT/decode_graphs.md" decode_graphs.log
  fi

  # The 256-request throughput trace; transformers in one static batch of all 256 requests.
  if wants throughput && has_time 60 "end-to-end throughput vs transformers"; then
    timeout "$(budget 150)" "$PY" "$SRC/bench/bench_throughput.py" --device cuda \
      --systems vpage-bfloat16,transformers-bfloat16 --hf-batch-sizes 256 \
      --json "$OUT/throughput.json" > "$OUT/throughput.md" 2> "$OUT/throughput.log"
    section "End-to-end throughput, 256-request trace (vpage vs transformers generate)" "$OUT/throughput.md" \
      throughput.log
  fi

  if wants swap && has_time 15 "engine swap bandwidth"; then
    timeout "$(budget 30)" "$PY" "$SRC/bench/bench_swap_cuda.py" --blocks 16,64,256 --repeats 10 \
      --out "$OUT/swap_engine.md" > "$OUT/swap_engine.log" 2>&1
    section "Engine swap bandwidth (CacheEngine, cache stream, pinned pool)" "$OUT/swap_engine.md" swap_engine.log
    note ""
    note "Target: >= 40 GB/s one way for batched transfers of >= 1 MB."
  fi

  if wants sdpa && has_time 20 "paged decode vs torch SDPA"; then
    timeout "$(budget 45)" "$PY" "$SRC/bench/bench_attention_cuda.py" --batch 1,16,64 \
      --context 512,2048,8192 --repeats 10 --out "$OUT/sdpa.md" > "$OUT/sdpa.log" 2>&1
    section "Paged decode vs torch SDPA (contiguous K/V)" "$OUT/sdpa.md" sdpa.log
  fi
else
  note ""
  note "- engine benchmarks and SDPA comparisons: skipped ($NOPY)"
fi
kill $CLOCKS_PID 2>/dev/null
note ""
# Samples with the GPU busy (utilization >= 50%): SM clock min / median / max, power max.
note "- SM clock while busy (MHz; max clock $(head -1 "$OUT/clocks.csv" | cut -d, -f3 | tr -d ' ')): $(awk -F', *' \
  '$1 >= 50 {print $2}' "$OUT/clocks.csv" | sort -n | awk '{v[NR]=$1} END {if (NR) print v[1] " / " \
  v[int((NR+1)/2)] " / " v[NR] " in " NR " samples"; else print "no busy samples"}'); power max $(cut -d, -f4 \
  "$OUT/clocks.csv" | tr -d ' ' | sort -n | tail -1) W"
note "Total: $(( $(date +%s) - DEADLINE + 470 )) s"
