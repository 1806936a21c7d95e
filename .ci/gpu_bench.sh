#!/usr/bin/env bash
# Benchmarks and tools on a GPU machine, after .ci/gpu_check.sh built the extension (same
# TORCH_EXTENSIONS_DIR).  Stages, in the order given: w8a8 (bench_scaled_mm, rotate + flush at
# decode M), w8a8_decode (dev/bench_scaled_mm_decode), w8a8_configs (dev/bench_scaled_mm_configs: the
# SM90 tile configs forced at prefill M; CONFIGS_ARGS passes options), awq (bench_awq), awq_sanitize
# (compute-sanitizer memcheck + racecheck over the AWQ kernels), sass (the AWQ streaming
# kernel's SASS).  Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_bench_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
for stage in "$@"; do
  start=$SECONDS
  case "$stage" in
    w8a8)
      python3 benchmarks/bench_scaled_mm.py --out "$OUT/w8a8" > "$OUT/w8a8.log" 2>&1
      python3 benchmarks/bench_scaled_mm.py --timer flush --ms 1,16 --out "$OUT/w8a8_flush" > "$OUT/w8a8_flush.log" 2>&1
      grep -E "^N=" "$OUT/w8a8_flush.log" ;;
    w8a8_decode)
      python3 benchmarks/dev/bench_scaled_mm_decode.py --ms 1,16 --out "$OUT/w8a8_decode" > "$OUT/w8a8_decode.log" 2>&1 ;;
    w8a8_configs)
      python3 benchmarks/dev/bench_scaled_mm_configs.py --out "$OUT/w8a8_configs" ${CONFIGS_ARGS:-} > "$OUT/w8a8_configs.log" 2>&1
      grep -E "^ *(int8|float8)" "$OUT/w8a8_configs.log" ;;
    awq)
      python3 benchmarks/bench_awq.py --out "$OUT/awq" ${AWQ_ARGS:-} > "$OUT/awq.log" 2>&1 ;;
    awq_sanitize)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --print-limit 20 python3 benchmarks/bench_awq.py --sanitize \
          > "$OUT/awq_$tool.log" 2>&1
        tail -3 "$OUT/awq_$tool.log"
      done ;;
    sass)
      so=$(find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name '*.so' | head -1)
      cuobjdump -sass "$so" | awk '/Function : /{p = /awq_gemm_kernel/} p' > "$OUT/awq_gemm_kernel.sass"
      grep -c "" "$OUT/awq_gemm_kernel.sass" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "stage $stage: rc=$? $((SECONDS - start)) s"
done
