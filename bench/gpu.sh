#!/usr/bin/env bash
# For whoever has a GPU (issue 47): every `gpu` test, then every section of bench/gpu.py (its docstring says what each
# measures), the data made beside the tests. Needs torch with CUDA, nvidia-dali-cuda12x/13x, torchvision (the train
# section's ResNet-50), PyAV (the tests' and the video section's media) and megatron-core (the tokens peer).
# Usage: bench/gpu.sh [OUT] [REPEATS]   (OUT: bench/out/gpu; writes OUT/log.txt, OUT/gpu-SECTION.json, OUT/results.tgz)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${1:-bench/out/gpu}
REPEATS=${2:-2}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "bench/gpu.sh: torch sees no CUDA GPU")' || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$LOG" 2>&1
"$PY" -m bench.gpu prepare --out "$OUT" >"$OUT/prepare.txt" 2>&1 &
prep=$!
echo "== gpu tests $(date +%T)" >>"$LOG"
timeout "${GPU_TESTS_S:-200}" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rA --timeout 120 \
  tests/test_loader.py tests/test_loader_resume.py tests/test_cuda_delivery.py tests/test_checkpoint.py tests/test_checkpoint_fsdp.py \
  tests/test_media.py tests/test_media_nvdec.py tests/test_media_fallback.py tests/test_media_rotation.py >>"$LOG" 2>&1
echo "== gpu tests rc=$? $(date +%T)" >>"$LOG"
wait "$prep"
echo "== prepare rc=$? $(date +%T)" >>"$LOG"
cat "$OUT/prepare.txt" >>"$LOG"
for s in ${SECTIONS:-decode loader train video tokens image_text}; do
  echo "== $s $(date +%T)" >>"$LOG"
  timeout "${SECTION_S:-150}" "$PY" -m bench.gpu "$s" --repeats "$REPEATS" --out "$OUT" >>"$LOG" 2>&1
  echo "== $s rc=$? $(date +%T)" >>"$LOG"
  tar -czf "$OUT/results.tgz" -C "$OUT" $(cd "$OUT" && ls gpu-*.json 2>/dev/null) 2>/dev/null
done
