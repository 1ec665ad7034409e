"""Our Triton kernels must never pass for the Hugging Face `kernels` package, which transformers imports.

They live inside the package (trace_lightning/kernels), so nothing named `kernels` is importable from the
repo root: a top-level `kernels/` folder shadowed the real package whenever the working directory was on
sys.path (`python -m pytest`, `python -c`, notebooks), and transformers >= 5.2x, which depends on it, then
failed to import its hub-kernel integration.
"""

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import importlib.util as u; from transformers.utils import is_kernels_available; "
         "s = u.find_spec('kernels'); print(is_kernels_available(), s.origin if s else None)")


def probe(cwd: Path) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    available, origin = out.stdout.strip().splitlines()[-1].split(" ", 1)
    return available, origin


def test_repo_root_does_not_shadow_hf_kernels() -> None:
    with tempfile.TemporaryDirectory() as elsewhere:
        expected = probe(Path(elsewhere))
    available, origin = probe(ROOT)
    assert (available, origin) == expected
    assert not origin.startswith(str(ROOT)), origin


def test_transformers_hub_kernels_import_from_repo_root() -> None:
    if importlib.util.find_spec("transformers.integrations.hub_kernels") is None:
        pytest.skip("this transformers has no hub-kernel integration")
    code = "import transformers.integrations.hub_kernels as h; print(h.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "transformers.integrations.hub_kernels"


def test_our_kernels_import_under_the_package_name() -> None:
    code = "import trace_lightning.kernels as k, trace_lightning.sim as s; print(k.__name__, s.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["trace_lightning.kernels", "trace_lightning.sim"]
