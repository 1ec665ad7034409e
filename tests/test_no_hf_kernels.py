"""Our top-level kernels/ folder must not pass for the Hugging Face `kernels` package.

From the repo root `kernels/` is importable as a top-level module (cwd is on sys.path), so transformers
must still report is_kernels_available() False, or it would try to load hub kernels through our folder.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_transformers_does_not_see_hf_kernels_from_repo_root() -> None:
    code = "from transformers.utils import is_kernels_available; print(is_kernels_available())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_our_kernels_import_under_the_package_name() -> None:
    code = "import trace_lightning.kernels as k, trace_lightning.sim as s; print(k.__name__, s.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["trace_lightning.kernels", "trace_lightning.sim"]
