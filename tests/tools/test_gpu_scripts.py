"""tools/gpu_*.sh behave like tools: an output folder argument (default ./gpu_out), nothing installed unless
--install asks, and a one-line hint when the package is missing."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "tools").glob("gpu_*.sh"))


def test_every_gpu_script_takes_the_shared_options_and_installs_nothing_itself() -> None:
    assert len(SCRIPTS) >= 5
    for script in SCRIPTS:
        text = script.read_text()
        assert 'source "$(dirname "$0")/_gpu_args.sh"' in text, script.name
        assert "pip install" not in text and "/tmp/out" not in text, script.name
    assert not (ROOT / "tools" / "gpu_wheels.sh").exists() and (ROOT / "tools" / "offline_wheels.sh").is_file()


def shared_args(tmp_path: Path, *args: str, python_ok: bool = True) -> subprocess.CompletedProcess:
    """Source tools/_gpu_args.sh with ``args`` and a python3 that imports (or fails to)."""
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text(f"#!/bin/sh\nexit {0 if python_ok else 1}\n")
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"PATH": f"{shim.parent}:/usr/bin:/bin"}
    code = f'cd {tmp_path} && source {ROOT}/tools/_gpu_args.sh && echo "$OUT|$INSTALL|$*"'
    return subprocess.run(["bash", "-c", code, "script", *args], env=env, capture_output=True, text=True, timeout=30)


def test_out_folder_defaults_to_gpu_out_and_positionals_pass_through(tmp_path: Path) -> None:
    run = shared_args(tmp_path, "30", "fit")
    assert run.returncode == 0 and run.stdout.strip() == "./gpu_out|0|30 fit"
    assert (tmp_path / "gpu_out").is_dir()
    run = shared_args(tmp_path, "30", "--out", "logs/a", "fit")
    assert run.stdout.strip() == "logs/a|0|30 fit" and (tmp_path / "logs" / "a").is_dir()


def test_a_missing_package_stops_with_a_hint_instead_of_installing(tmp_path: Path) -> None:
    run = shared_args(tmp_path, python_ok=False)
    assert run.returncode == 2 and run.stdout == ""
    assert "pip install -e ." in run.stderr and "--install" in run.stderr and len(run.stderr.splitlines()) == 1
