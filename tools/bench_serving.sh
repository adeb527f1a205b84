#!/usr/bin/env bash
# Issue 18's speed checks in one run (SmolLM2-135M fp32, greedy, the ops prompts, 256 new tokens):
#  1. HTTP against the in-process scheduler: plain decoding at concurrency 1 (TTFT) and 16 (throughput),
#     a `--method none` server (no n-gram table to write, as the in-process plain scheduler);
#  2. one server, speculation per request: "off" against "auto" at concurrency 1 and 16;
#  3. the surge (light -> peak -> light) against the same server, off against auto.
# Same slots and batch sizes everywhere: 16 slots, chunks at batch 1, 2, 4, 8 or 16; the server's
# caches sized as the in-process scheduler sizes its own (the longest prompt with the chat template:
# 127 tokens in the shipped ops set, 81 in the ops-dev file of the figures in docs/BENCHMARKS.md; + 256):
# a server sized for 512-token prompts attends over 2-2.3x the cache at every step.
# Usage: tools/bench_serving.sh [OUT_DIR] [STAGES] (JSON per stage there; a quiet machine: ~25 min here).
# OPS=FILE (default: the shipped `ops` set) and MAX_PROMPT=TOKENS (its longest prompt) serve other prompts.
# STAGES: "inproc,http-plain,http-auto" (default) or some of them.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/bench_serving}
mkdir -p "$OUT"
SJ=.venv/bin/specjax
OPS=${OPS:-ops}
PORT=${PORT:-8017}
URL=http://127.0.0.1:$PORT
COMMON=(--prompts-file "$OPS" --chat --max-new-tokens 256)
STEP_COST=${STEP_COST:-1.5}
MAX_PROMPT=${MAX_PROMPT:-127}

STAGES=${2:-inproc,http-plain,http-auto}
if [[ $STAGES == *inproc* ]]; then
    echo "== in-process scheduler, plain ==" >&2
    $SJ loadbench "${COMMON[@]}" --per-task 4 --methods none --concurrency 1 --json "$OUT/inproc_c1.json"
    $SJ loadbench "${COMMON[@]}" --per-task 16 --methods none --concurrency 16 --batch-sizes 1,2,4,8 \
        --json "$OUT/inproc_c16.json"
fi

SERVER=
trap '[[ -z $SERVER ]] || { kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; } || true' EXIT
serve() {  # serve METHOD LOG [FLAGS...]: starts a server on $PORT and waits until it is warm
    local method=$1 log=$2
    shift 2
    $SJ serve --model smollm2-135m --method "$method" --slots 16 --batch-sizes 1,2,4,8 --max-tokens 256 \
        --max-prompt-tokens "$MAX_PROMPT" --max-queue 256 --port "$PORT" "$@" 2> "$log" &
    SERVER=$!
    for _ in $(seq 600); do
        curl -sf "$URL/health" >/dev/null && return 0
        kill -0 $SERVER 2>/dev/null || { echo "the server exited during warm-up (see $log)" >&2; exit 1; }
        sleep 1
    done
    echo "the server was not ready after 600 s" >&2
    exit 1
}
stop_server() { kill -TERM $SERVER; wait $SERVER || true; SERVER=; }

if [[ $STAGES == *http-plain* ]]; then
    echo "== server: plain decoding (the in-process scheduler's configuration) ==" >&2
    serve none "$OUT/server_plain.log"
    $SJ loadbench --url "$URL" "${COMMON[@]}" --per-task 4 --methods none --concurrency 1 \
        --json "$OUT/http_plain_c1.json"
    $SJ loadbench --url "$URL" "${COMMON[@]}" --per-task 16 --methods none --concurrency 16 \
        --json "$OUT/http_plain_c16.json"
    stop_server
fi
[[ $STAGES == *http-auto* ]] || exit 0

echo "== server: auto over prompt lookup, step cost <= $STEP_COST ==" >&2
serve auto "$OUT/server_auto.log" --auto-methods ngram --auto-max-step-cost "$STEP_COST"

$SJ loadbench --url "$URL" "${COMMON[@]}" --per-task 4 --methods none,auto --concurrency 1 \
    --json "$OUT/http_c1.json"
$SJ loadbench --url "$URL" "${COMMON[@]}" --per-task 16 --methods none,auto --concurrency 16 \
    --json "$OUT/http_c16.json"
$SJ loadbench --url "$URL" "${COMMON[@]}" --methods none,auto --surge 0.5:30,2:30,0.5:30 --concurrency 16 \
    --json "$OUT/http_surge.json"
curl -sf "$URL/metrics" > "$OUT/metrics.txt" || true
echo "results in $OUT" >&2
