"""Each library installs alone with pip and imports with nothing else of the repository on the
path: its pyproject lists its code and assets, and it needs no sibling library it does not
declare (mesh is the only one the parallel libraries may use)."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

# not resolve(): under Bazel the declared runfiles copy of each library is what gets installed
LIBS = Path(__file__).absolute().parent.parent / "libs"
# Tessera libraries a library may import (DEVELOPERS.md): installed next to it in the test.
ALLOWED = {"mesh": [], "models": ["mesh"], "data": [], "fsdp": ["mesh"], "tp": ["mesh"], "ckpt": ["mesh"], "float8": ["mesh"],
           "pp": ["mesh"], "cp": ["mesh"], "ep": ["mesh"], "optim": []}
SMOKE = {
    "mesh": "from tessera.mesh import resolve_parallel_dims; assert resolve_parallel_dims(4, tp=2).dp_shard == 2",
    "models": "from tessera.models import get_model_spec; assert 'debugmodel' in get_model_spec('llama3').flavors",
    "data": "from tessera.data import load_tokenizer, load_dataset; assert load_tokenizer().vocab_size == 2048; assert len(load_dataset()) > 100",
    "fsdp": "from tessera.fsdp import apply_fsdp, clip_grad_norm_",
    "tp": "from tessera.tp import apply_tp, check_tp_degree",
    "ckpt": "from tessera.ckpt import CheckpointManager, save_hf, load_hf",
    "float8": "from tessera.float8 import Float8Options, check_options, convert, tp_styles",
    "pp": "from tessera.pp import build_pipeline, even_split; assert len(even_split(2, 4)) == 2",
    "cp": "from tessera.cp import apply_cp, local_positions; assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]",
    "ep": "from tessera.ep import apply_ep, check_ep_degree, find_experts; check_ep_degree(8, 4)",
    "optim": "from tessera.optim import Muon, orthogonalise; import torch; assert orthogonalise(torch.eye(3)).shape == (3, 3)",
}


def pip_install(lib: str, target: Path, scratch: Path) -> None:
    source = scratch / lib
    shutil.copytree(LIBS / lib, source, ignore=shutil.ignore_patterns("tests", "__pycache__", "BUILD"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-cache-dir", "--disable-pip-version-check", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True, cwd=scratch,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """name -> its own site folder, each library installed once (a dependency serves every
    library that may import it)."""
    folders = {}

    def install(name):
        if name not in folders:
            scratch = tmp_path_factory.mktemp(f"pip-{name}")
            pip_install(name, scratch / "site", scratch)
            assert not (scratch / "site" / "tessera" / "__init__.py").exists(), "tessera must stay a namespace package"
            folders[name] = scratch / "site"
        return folders[name]

    return install


@pytest.mark.parametrize("lib", sorted(ALLOWED))
def test_library_installs_and_imports_alone(lib, tmp_path, installed):
    # one folder each, as separate site installs would be (pip --target skips a tessera/ already there);
    # the PEP 420 namespace joins them
    targets = [installed(name) for name in [lib, *ALLOWED[lib]]]
    target = targets[0]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RUNFILES_DIR", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = os.pathsep.join(map(str, targets))
    code = f"import tessera.{lib} as m; assert m.__file__.startswith({str(target)!r}), m.__file__; {SMOKE[lib]}"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_library_is_covered():
    assert sorted(p.name for p in LIBS.iterdir() if (p / "pyproject.toml").exists()) == sorted(ALLOWED)


def test_each_library_declares_the_libraries_it_imports():
    """pip installs a library's declared dependencies (``pip install ./libs/mesh ./libs/tp``): one
    imported but undeclared breaks a lone install, one declared but unused is a needless demand."""
    for lib in ALLOWED:
        project = tomllib.loads((LIBS / lib / "pyproject.toml").read_text())["project"]
        declared = {re.match(r"tessera-([a-z0-9]+)", dep).group(1)
                    for dep in project["dependencies"] if dep.startswith("tessera-")}
        imported = {name for source in (LIBS / lib / "tessera" / lib).rglob("*.py")
                    for name in re.findall(r"^\s*(?:from|import) tessera\.(\w+)", source.read_text(), re.MULTILINE)
                    if name != lib}
        assert declared == imported, f"libs/{lib}/pyproject.toml declares {sorted(declared)}, its code imports {sorted(imported)}"
        assert imported <= set(ALLOWED[lib]), f"tessera.{lib} imports {sorted(imported - set(ALLOWED[lib]))}"
