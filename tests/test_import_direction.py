"""Static check of DEVELOPERS.md's direction of imports: every `tessera.<lib>` a library's code
imports (at any depth, lazily too) must be itself or one it may use."""

import ast
from pathlib import Path

import pytest

LIBS = Path(__file__).absolute().parent.parent / "libs"
MAY_IMPORT = {"mesh": set(), "models": {"mesh"}, "data": set(), "fsdp": {"mesh"}, "tp": {"mesh"}, "ckpt": {"mesh"},
              "float8": {"mesh"}, "pp": {"mesh"}, "cp": {"mesh"}, "ep": {"mesh"}, "optim": set()}


def tessera_imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found.update(n.split(".")[1] for n in names if n.startswith("tessera.") and n.count(".") >= 1)
    return found


@pytest.mark.parametrize("lib", sorted(MAY_IMPORT))
def test_library_imports_only_what_it_may(lib):
    files = sorted((LIBS / lib / "tessera" / lib).rglob("*.py"))
    assert files
    for path in files:
        bad = tessera_imports(path.read_text()) - MAY_IMPORT[lib] - {lib}
        assert not bad, f"{path.relative_to(LIBS)} imports tessera.{sorted(bad)}"


def test_the_scan_sees_lazy_imports():
    assert tessera_imports("def f():\n    from tessera.models import x\n    import tessera.tp.plan\n") == {"models", "tp"}


def test_every_library_is_covered():
    assert sorted(p.name for p in LIBS.iterdir() if (p / "pyproject.toml").exists()) == sorted(MAY_IMPORT)
