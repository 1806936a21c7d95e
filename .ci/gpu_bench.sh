#!/usr/bin/env bash
# Benchmarks and tools on a GPU machine, after .ci/gpu_check.sh built the extension (same
# TORCH_EXTENSIONS_DIR).  Stages, in the order given: w8a8 (bench_scaled_mm, rotate + flush at
# decode M), w8a8_decode (dev/bench_scaled_mm_decode), w8a8_configs (dev/bench_scaled_mm_configs: the
# SM90 tile configs forced at prefill M; CONFIGS_ARGS passes options), awq (bench_awq), awq_sanitize
# (compute-sanitizer memcheck + racecheck over the AWQ kernels), sass (the AWQ streaming
# kernel's SASS), act_order (bench_e2e: awq-g128 against the same model as a GPTQ act-order
# checkpoint loads), smollm2 (bench_e2e on the trained model, generate, every scheme), all_reduce
# (bench_all_reduce on 2 and, where present, 4 GPUs), tp (bench_tp at Llama-3-70B shapes on 1, 2 and
# 4 GPUs as present, merged; TP_CONFIGS, TP_ARGS).  Output under $OUT.
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
    act_order)
      python3 benchmarks/bench_e2e.py --configs awq-g128,awq-g128+act-order --paths loop --batch 1,8 \
        --no-accuracy --no-ttft --out "$OUT/act_order" > "$OUT/act_order.log" 2>&1 ;;
    smollm2)
      python3 benchmarks/bench_e2e.py --model smollm2 --paths generate --batch 1 --no-ttft \
        --out "$OUT/smollm2" > "$OUT/smollm2.log" 2>&1 ;;
    all_reduce)
      for n in 2 4; do
        [ "$(nvidia-smi -L | wc -l)" -ge $n ] && torchrun --nproc-per-node $n benchmarks/bench_all_reduce.py \
          --out "$OUT/all_reduce" > "$OUT/all_reduce_$n.log" 2>&1
      done ;;
    tp)
      gpus=$(nvidia-smi -L | wc -l)
      for n in 1 2 4; do
        [ "$gpus" -ge $n ] || continue
        configs=${TP_CONFIGS:-awq-g128,bf16,int8,fp8-rowwise}
        [ $n -eq 1 ] && configs=awq-g128  # the dense 70B model does not fit one GPU
        torchrun --nproc-per-node $n benchmarks/bench_tp.py --model llama-3-70b --dtype bfloat16 \
          --configs "$configs" ${TP_ARGS:-} --out "$OUT/tp" > "$OUT/tp_$n.log" 2>&1
      done
      python3 benchmarks/bench_tp.py --merge "$OUT"/tp/results_tp_*gpu.json --out "$OUT/tp" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "stage $stage: rc=$? $((SECONDS - start)) s"
done
