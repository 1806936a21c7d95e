#!/usr/bin/env bash
# The whole check on a GPU machine without network (the lent H100): install the package
# (no dependencies fetched), build the CUDA extension, run the full test suite (CPU and GPU
# tests), then the demo. CUTLASS comes as a wheel in .whl/ when the machine lacks it.
# Logs go to $OUT (or ./gpu_check_out).  Knobs: PYTEST_ARGS, PYTEST_WORKERS, SKIP_DEMO=1,
# QUANTFUSE_CSRC_ONLY (build a subset of csrc/, see compile_backend/kernels/loader.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
start=$SECONDS
python3 -m compile_backend.kernels.build 2>&1 | tee "$OUT/build.log" | tail -3
echo "build: $((SECONDS - start)) s"
python3 -m pytest -q -n ${PYTEST_WORKERS:-8} -p no:cacheprovider ${PYTEST_ARGS:-tests/} --junitxml="$OUT/junit.xml" \
  > "$OUT/pytest.log" 2>&1
rc=$?
tail -25 "$OUT/pytest.log"
echo "tests: rc=$rc, $((SECONDS - start)) s"
if [ -z "${SKIP_DEMO:-}" ]; then
  timeout ${DEMO_TIMEOUT:-150} python3 -m compile_backend.demo 2>&1 | tee "$OUT/demo.log" | tail -20
fi
exit $rc
