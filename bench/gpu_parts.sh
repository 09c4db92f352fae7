#!/usr/bin/env bash
# Packs what bench/gpu.sh needs beyond the GPU machine's image (Python 3.12, torch, torchvision, pytest-timeout there)
# for an offline machine that takes small transfers: DALI's cp312 build and its nvImageCodec/nvJPEG/nvCOMP wheels,
# PyAV, megatron-core, torchsnapshot (and two of its dependencies), webdataset, obstore, zstandard, ... installed here
# into one site folder (only the cp312 DALI binding kept, no headers), xz-compressed and split into parts of PART_MB
# under .gpu/pN/ (ignored by git): 4 parts of 56 MiB where the wheels take 9 of 40. The last part holds install.sh.
# On the GPU machine: one call per part, each `mkdir -p /tmp/gpu && cp .gpu/pK/* /tmp/gpu/` (carry .gpu/pK), the last
# one then: SP=$(bash /tmp/gpu/install.sh | tail -1); export PYTHONPATH=$PWD; [ "$SP" = /tmp/site ] &&
# PYTHONPATH=/tmp/site:$PWD; COPY_TO=$OUT PYTHON=python3 bash bench/gpu.sh /tmp/res 2
# Usage (from the repo root): bash bench/gpu_parts.sh [PART_MB]
set -euo pipefail
part_mb=${1:-56}
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat=()
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
  plat+=(--platform "${p}_x86_64")
done
pip_for_312=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}")
python3 -m pip download -q "${pip_for_312[@]}" -d "$work/wheels" \
  nvidia-dali-cuda130==2.4.0 nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-libnvcomp-cu13==5.3.0.16 \
  nvidia-nvjpeg==13.3.2.43 nvidia-nvjpeg2k-cu13==0.11.0.51 nvidia-nvtiff-cu13==0.8.0.82 \
  astunparse gast optree nvtx makefun 'libcst~=1.8' webdataset braceexpand torchsnapshot==0.1.0 obstore zstandard \
  importlib-metadata nest-asyncio 'av>=14' megatron-core
python3 -m pip install -q "${pip_for_312[@]}" --ignore-requires-python --no-compile --no-index \
  --find-links "$work/wheels" --target "$work/site" "$work"/wheels/*.whl
find "$work/site/nvidia/dali" -maxdepth 1 -name 'backend_impl.cpython-*.so' ! -name '*cpython-312-*' -delete
rm -rf "$work/site/nvidia/dali/include" "$work/site/bin"
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
rm -rf .gpu && mkdir -p .gpu
tar -cf - -C "$work/site" . | xz -T0 -6 | split -b "${part_mb}M" -d -a 1 - .gpu/site.
n=0
for f in .gpu/site.*; do n=$((n + 1)); mkdir -p ".gpu/p$n"; mv "$f" ".gpu/p$n/"; done
cat > ".gpu/p$n/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Unpacks the carried site into python3's site-packages (else /tmp/site, to put on PYTHONPATH); prints that folder last.
set -uo pipefail
SP=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! touch "$SP/.fastio-w" 2>/dev/null; then SP=/tmp/site; mkdir -p "$SP"; echo "site-packages read-only: $SP"; fi
rm -f "$SP/.fastio-w"
unxz() { if command -v xz >/dev/null; then xz -d -T0; else python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)"; fi; }
cat $(ls /tmp/gpu/site.* | sort) | unxz | tar -x -C "$SP" --skip-old-files
echo "tar rc=$?"
echo "$SP"
INSTALL
echo "prepared $n parts under .gpu/:"
du -sh .gpu/p*
