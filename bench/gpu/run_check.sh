#!/bin/bash
# The GPU check (make gpu-check): on a machine with a CUDA GPU and no network, from the repository root.
#   bench/gpu/run_check.sh OUT_DIR [WHEELS_DIR]
# Builds random-weight models of SmolLM2-135M's and Llama-3.1-8B's shapes on the GPU (no download), runs
# the CUDA tests, then attnstore at its defaults (but the model, the tiers and max_running, as the
# reference check sets them): exactness on the 135M shape (reuse == recompute, batched == alone), speed
# and reuse on the 8B shape, the tiers' GB/s, the kernels' configs against torch's own (bench/gpu/
# kernels.py: how a config is chosen); then the same with batch_invariant true. Prints each
# figure; everything is kept in OUT_DIR (log.txt, pytest.txt, *.jsonl, serve.log, settings-*.json).
# Environment (defaults are the device check's):
#   PHASES    tests models perf tiers correct kernels exact (all, in that order: the most wanted first;
#             issue 36's figures, then 37's, then exactness and the kernels' own timings)
#   BUDGET_S  bounds the whole check (default none): each phase's time limit is cut to what is left and
#             a phase with under 30 s left is skipped, saying so, so that a device call with a hard limit
#             (600 s) returns every figure measured before it rather than being killed inside one
#   PY, PORT (8081), MODELS_DIR, MODELS (m135,m8b), MODEL_DEVICE (cuda), DEVICE (auto), PERF_MODEL (m8b),
#   LENGTHS, EXACT_LENGTHS, STREAMS, DECODE, CONVS, WORDS, TIER_TOKENS, TIER_LAYOUT, KERNEL_SHAPE: smaller
#   runs, such as tests/test_gpu_check.py's dry run of this script on a CPU
set -u
PY=${PY:-python3}
P=$(pwd); OUT=$(readlink -f "$1"); W=${2:-}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s); el() { echo "=== $(( $(date +%s) - T0 )) s: $*"; }
BUDGET_S=${BUDGET_S:-0}
lim() {  # lim SECONDS: the phase's own limit, or what is left of BUDGET_S (10 s kept to stop a server)
  local left=$(( BUDGET_S - ($(date +%s) - T0) - 10 ))
  if [ "$BUDGET_S" -le 0 ] || [ "$1" -le "$left" ]; then echo "$1"; else echo "$(( left > 1 ? left : 1 ))"; fi
}
PHASES=${PHASES:-"tests models perf tiers correct kernels exact"}
has() {  # has PHASE: asked for, and BUDGET_S leaves it 30 s
  [[ " $PHASES " == *" $1 "* ]] || return 1
  [ "$BUDGET_S" -le 0 ] || [ "$(( BUDGET_S - ($(date +%s) - T0) ))" -ge 30 ] && return 0
  el "skip $1: under 30 s of BUDGET_S=$BUDGET_S left"; return 1
}
el env; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -n "$W" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$W"/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$P
else
  export PYTHONPATH=$P
fi
export PYTHONUNBUFFERED=1
$PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" || exit 4
M=${MODELS_DIR:-/dev/shm/attnstore-models}
[ -n "${MODELS_DIR:-}" ] || [ "$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)" -gt 40 ] || M=/tmp/attnstore-models
PORT=${PORT:-8081}
TP=""
# reads the driver's free memory around an allocation of its own: alone, not beside the models' build
MEMORY_TEST=tests/test_kvtier_cuda.py::test_device_memory_falls_by_what_is_held
if has tests; then  # the CUDA tests, beside the models' build (both are short of the device)
  el cuda-tests-start
  # SIGINT at the limit: pytest then stops as on ^C and still prints what failed so far (-rfE)
  (timeout -s INT -k 20 "$(lim 200)" $PY -m pytest -q -rfE -p no:cacheprovider tests/test_kvtier_cuda.py tests/test_triton_attention.py \
    tests/test_triton_ops.py tests/test_kvtier.py tests/test_reuse_policy.py tests/test_cuda_step.py tests/test_kernel_choice.py \
    --deselect "$MEMORY_TEST" > "$OUT/pytest.txt" 2>&1; echo "pytest rc $?" >> "$OUT/pytest.txt") & TP=$!
fi
if has models; then
  el models
  timeout "$(lim 200)" $PY -m bench.gpu.make_models "$M" --models ${MODELS:-m135,m8b} --device ${MODEL_DEVICE:-cuda} || echo "make_models rc $?"
fi
if [ -n "$TP" ]; then
  wait $TP
  timeout "$(lim 60)" $PY -m pytest -q -p no:cacheprovider "$MEMORY_TEST" >> "$OUT/pytest.txt" 2>&1
  echo "pytest (alone) rc $?" >> "$OUT/pytest.txt"
  el cuda-tests; tail -15 "$OUT/pytest.txt"
fi
SP=""
serve() {  # serve PHASE MODEL TAG
  local kv="/tmp/attnstore-kv-$PORT-$3"
  $PY -m bench.gpu.settings "$1" "$M/$2" "$2" "$kv" > "$OUT/settings-$3.json"
  rm -rf "$kv"
  echo "===== serve $3: $(date +%T)" >> "$OUT/serve.log"
  $PY -m proxy serve --settings "$OUT/settings-$3.json" --port "$PORT" >> "$OUT/serve.log" 2>&1 & SP=$!
}
stop() { kill $SP 2>/dev/null; for _ in 1 2 3 4 5; do kill -0 $SP 2>/dev/null || break; sleep 1; done; kill -9 $SP 2>/dev/null; sleep 1; rm -rf /tmp/attnstore-kv-"$PORT"-*; }
health() { $PY -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read()[:3000].decode(errors='replace'))" "http://127.0.0.1:$PORT/healthz" || echo "no /healthz"; }
# ready SECONDS: the server warmed up (so nothing times the start), or why not: it died (its log's end
# printed at once, not after the drive's limit) or is too slow; the phase's drive is skipped then
ready() { timeout "$(( $(lim "$1") + 10 ))" $PY -m bench.gpu.ready --url "http://127.0.0.1:$PORT" --pid "$SP" --limit "$(lim "$1")" --log "$OUT/serve.log"; }
drive() { timeout "$(lim "$1")" $PY bench/gpu/drive.py --base "http://127.0.0.1:$PORT" "${@:2}" > /dev/null; }
if has perf; then
  el speed-8b-shape
  serve perf ${PERF_MODEL:-m8b} perf
  if ready 240; then  # the first start on a device also measures the model's kernel configs
    drive 240 --model ${PERF_MODEL:-m8b} --phase perf --out "$OUT/perf.jsonl" --lengths ${LENGTHS:-1000,4000,8000,16000,22000,30000} --streams ${STREAMS:-1,8,32} --decode ${DECODE:-128}
    health; $PY bench/gpu/drive.py --summarize "$OUT/perf.jsonl"
  fi
  stop
fi
if has tiers; then
  el tiers
  timeout "$(lim 120)" $PY -m bench.tier_transfers --tokens ${TIER_TOKENS:-8192} --reps 3 --layout ${TIER_LAYOUT:-8b}
fi
if has correct; then
  el correctness-135m-shape
  serve correct m135 correct
  if ready 150; then  # the 135M shape's first start measures its kernel configs too (up to ~120 s)
    drive 150 --model m135 --phase correct --out "$OUT/correct.jsonl" --convs ${CONVS:-6} --words ${WORDS:-300}
    health; grep -E '"summary' "$OUT/correct.jsonl" | cut -c1-400
  fi
  stop
fi
if has kernels; then  # the attention's and the invariant product's configs, timed against torch's own
  el kernels
  timeout "$(lim 90)" $PY -m bench.gpu.kernels --shape ${KERNEL_SHAPE:-8b} --out "$OUT/kernels.jsonl"
fi
if has exact; then
  el exact-batch-invariant
  BI=1 serve correct m135 exact-correct
  if ready 60; then
    drive 150 --model m135 --phase correct --out "$OUT/exact-correct.jsonl" --convs ${CONVS:-6} --words ${WORDS:-300}
    health; grep -E '"summary' "$OUT/exact-correct.jsonl" | cut -c1-400
  fi
  stop
  BI=1 serve perf ${PERF_MODEL:-m8b} exact-perf
  if ready 120; then
    drive 200 --model ${PERF_MODEL:-m8b} --phase perf --out "$OUT/exact-perf.jsonl" --lengths ${EXACT_LENGTHS:-1000,8000,16000,22000} --streams ${STREAMS:-1,8,32} --decode ${DECODE:-128}
    health; $PY bench/gpu/drive.py --summarize "$OUT/exact-perf.jsonl"
  fi
  stop
fi
el done
