#!/usr/bin/env bash
# For whoever has a GPU: the Loader's GPU tests (images; video clips with NVDEC, VP9 and H.264), then the loader
# comparison of `make bench` with device="cuda": fastio (mixed nvJPEG / hardware decode into GPU memory) against DataLoader+WebDataset
# (PIL decode on the CPU, then .to("cuda")) and DALI's own webdataset reader decoding on the GPU.
# Needs torch with CUDA and nvidia-dali-cuda12x/13x. Under 5 minutes on one GPU.
# Usage: bench/gpu.sh [REPEATS] [SAMPLES]   (writes bench/out/loader-cuda.json and .png)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "bench/gpu.sh: torch sees no CUDA GPU")'
"$PY" -m pytest -q -m gpu tests/test_loader.py tests/test_loader_resume.py tests/test_media.py tests/test_media_nvdec.py
# 4000 JPEGs: enough for a GPU loader to reach steady state; the CPU peer takes well under a minute per epoch.
exec "$PY" bench/loader.py --device cuda --repeats "${1:-3}" --samples "${2:-4000}"
