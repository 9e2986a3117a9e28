#!/usr/bin/env bash
# Run peer quantization jobs ONE AT A TIME (2 cores: concurrent runs oversubscribe the CPU and
# distort the wall times badly), each with its own venv python, under /usr/bin/time -v when present.
#
#   bash benchmarks/peers/run_all.sh CALIB.pt TAG [tool:method ...]
#   e.g. bash benchmarks/peers/run_all.sh benchmarks/.cache/calib_128x512.pt full \
#            llmcompressor:gptq gptqmodel:gptq llmcompressor:awq gptqmodel:awq
#
# Output: benchmarks/.cache/runs/<TAG>-<tool>-<method>/{result.json,dequantized/,time.txt}
# Logs:   benchmarks/.cache/logs/<TAG>-<tool>-<method>.log
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CALIB="$1"; TAG="$2"; shift 2
MODEL="${MODEL:-$ROOT/benchmarks/.cache/smollm2-135m-hf}"
jobs=("$@")
[[ ${#jobs[@]} -eq 0 ]] && jobs=(llmcompressor:gptq gptqmodel:gptq llmcompressor:awq gptqmodel:awq)
mkdir -p "$ROOT/benchmarks/.cache/logs" "$ROOT/benchmarks/.cache/runs"
TIMEV=()
[[ -x /usr/bin/time ]] && TIMEV=(/usr/bin/time -v)

for j in "${jobs[@]}"; do
    tool="${j%%:*}"; method="${j##*:}"
    out="$ROOT/benchmarks/.cache/runs/$TAG-$tool-$method"
    log="$ROOT/benchmarks/.cache/logs/$TAG-$tool-$method.log"
    mkdir -p "$out"
    echo "[$(date -u +%FT%TZ)] start $tool $method -> $out" | tee -a "$ROOT/benchmarks/.cache/logs/$TAG-queue.log"
    "${TIMEV[@]}" "$ROOT/benchmarks/.venvs/$tool/bin/python" "$HERE/run_$tool.py" \
        --model "$MODEL" --calib "$CALIB" --method "$method" --bits 4 --group-size 64 \
        --out "$out" >"$log" 2>&1
    rc=$?
    grep -E "Maximum resident|Elapsed \(wall" "$log" > "$out/time.txt" 2>/dev/null || true
    echo "[$(date -u +%FT%TZ)] end $tool $method rc=$rc" | tee -a "$ROOT/benchmarks/.cache/logs/$TAG-queue.log"
done
