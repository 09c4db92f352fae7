#!/usr/bin/env bash
# For whoever has a GPU (issue 47): every `gpu` test, then each section of bench/gpu.py (its docstring says what each
# measures), the data made beside the tests. Needs torch with CUDA, nvidia-dali-cuda12x/13x, torchvision (the train
# section's ResNet-50), PyAV (the tests' and the video section's media), pytest-timeout and megatron-core (the tokens
# peer). Stops starting sections DEADLINE_S seconds after its start (default 560: one 10-minute slot); the tests are
# stopped at GPU_TESTS_S (180), the data's preparation at PREPARE_S (300), each section at its cap (SECTION_S).
# Usage: bench/gpu.sh [OUT] [REPEATS]   (OUT: bench/out/gpu; writes OUT/log.txt, OUT/gpu-SECTION.json and
# OUT/results.tgz; with COPY_TO set, copies log.txt and results.tgz there after each step)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${1:-bench/out/gpu}
REPEATS=${2:-2}
DEADLINE_S=${DEADLINE_S:-560}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1
step_done() {
  echo "== $1 rc=$2 at $((SECONDS))s" >>"$LOG"
  tar -czf "$OUT/results.tgz" -C "$OUT" $(cd "$OUT" && ls gpu-*.json prepare.txt 2>/dev/null) 2>/dev/null
  [ -n "${COPY_TO:-}" ] && cp "$LOG" "$OUT/results.tgz" "$COPY_TO"/ 2>/dev/null
  return 0
}
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "bench/gpu.sh: torch sees no CUDA GPU")' || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$LOG" 2>&1
timeout -k 10 "${PREPARE_S:-300}" "$PY" -m bench.gpu prepare --out "$OUT" >"$OUT/prepare.txt" 2>&1 &
prep=$!
# At GPU_TESTS_S, SIGINT: pytest stops and prints what ran (a Checkpointer a test leaves open keeps a SIGTERM handler
# that only sets a flag, so TERM would not stop it); KILL 15 s later if it is stuck.
timeout -s INT -k 15 "${GPU_TESTS_S:-180}" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rA --timeout 120 \
  tests/test_loader.py tests/test_loader_resume.py tests/test_cuda_delivery.py tests/test_checkpoint.py \
  tests/test_checkpoint_fsdp.py tests/test_media.py tests/test_media_nvdec.py tests/test_media_fallback.py \
  tests/test_media_rotation.py >>"$LOG" 2>&1 &
tests=$!
wait "$tests"
step_done "gpu tests" $?
wait "$prep"
step_done prepare $?
for s in ${SECTIONS:-loader train decode video tokens image_text}; do
  left=$((DEADLINE_S - SECONDS))
  [ "$left" -lt 25 ] && { echo "== $s not started: ${left}s left of DEADLINE_S" >>"$LOG"; continue; }
  declare -A caps=([loader]=120 [train]=90 [decode]=60 [video]=60 [tokens]=45 [image_text]=60)
  cap=${SECTION_S:-${caps[$s]:-60}}
  [ "$cap" -gt "$left" ] && cap=$left
  echo "== $s (at most ${cap}s) at ${SECONDS}s" >>"$LOG"
  # TERM at the cap (bench.gpu then writes what the section measured so far), KILL 10 s later if it is stuck
  timeout -k 10 "$cap" "$PY" -m bench.gpu "$s" --repeats "$REPEATS" --out "$OUT" >>"$LOG" 2>&1
  step_done "$s" $?
done
