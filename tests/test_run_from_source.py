"""tools/run_from_source.sh: the checkout runs under the interpreter it is given, without Bazel or
an install, and the wheels in .gpu_bundle/ are unpacked once, whole, ahead of the interpreter's
own packages."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).absolute().parents[1]
SCRIPT = ROOT / "tools" / "run_from_source.sh"


def _run(script: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but what the script sets
    return subprocess.run([str(script), *argv], env={**env, "PYTHON": sys.executable}, capture_output=True, text=True)


def test_the_trainer_and_the_tools_import_and_check_a_plan():
    proc = _run(SCRIPT, "-m", "tessera.trainer.main", "--check", "--check_world_size", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "llama3/debugmodel" in proc.stdout
    proc = _run(SCRIPT, "-c", "import step_time, estimate, tessera.pp, tessera.ckpt")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_bundled_wheels_are_unpacked_once_ahead_of_installed_packages(tmp_path):
    root = tmp_path / "checkout"
    (root / "tools").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "tools")
    for folder in ("libs", "apps"):
        (root / folder).symlink_to(ROOT / folder)
    (root / ".gpu_bundle").mkdir()
    with zipfile.ZipFile(root / ".gpu_bundle" / "pytest-0.0.1-py3-none-any.whl", "w") as wheel:
        wheel.writestr("pytest/__init__.py", "BUNDLED = True\n")  # shadows the interpreter's own pytest
    proc = _run(root / "tools" / "run_from_source.sh", "-c", "import pytest; print(pytest.BUNDLED)")
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]
    (site,) = (root / ".gpu_bundle" / "site").iterdir()
    assert site.name == "pytest-0.0.1-py3-none-any"
    (site / "pytest" / "__init__.py").write_text("BUNDLED = 'kept'\n")  # a second run does not unpack again
    proc = _run(root / "tools" / "run_from_source.sh", "-c", "import pytest; print(pytest.BUNDLED)")
    assert proc.stdout.strip() == "kept", proc.stderr[-2000:]
