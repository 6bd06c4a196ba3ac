"""What `--help` and `--version` print: the config keys with defaults and meanings (as declared
beside their fields, tessera.trainer.schema), and the versions a bug report needs (trainer, each
library, torch, git commit)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
from pathlib import Path

import tomllib

from tessera.trainer.config import ConfigError, JobConfig, get_key
from tessera.trainer.schema import NEWER_TORCHTITAN, OLDER_TORCHTITAN, TESSERA, declared

TRAINER_VERSION = "0.25.1"
LIBRARIES = ("mesh", "models", "data", "fsdp", "tp", "pp", "cp", "ep", "ckpt", "float8", "optim")

USAGE = """usage: trainer [--nproc N [--hosts H0,H1,... --node_rank R --port P] [--max_restarts K]]
               [--check [--check_world_size N] [--check_device cpu|cuda]] [--job.config_file F] [--section.key VALUE ...]
       trainer --help [SECTION]    the config keys (of one section), their defaults and meanings
       trainer --version           versions of the trainer, its libraries, torch, and the git commit"""


# How the README's key table names a key's origin (none: torchtitan 0.2.2's name).
_ORIGIN_NOTES = {TESSERA: "Tessera", OLDER_TORCHTITAN: "torchtitan 0.1 name", NEWER_TORCHTITAN: "torchtitan main's name"}


def _default(key: str) -> str:
    value = get_key(JobConfig(), key)
    return "unset" if value is None else repr(value)


def help_text(section: str | None = None) -> str:
    """The keys of every section, or of `section` (ConfigError naming an unknown one)."""
    keys = declared(JobConfig)
    sections = list(dict.fromkeys(key.split(".")[0] for key in keys))
    if section is not None:
        if section not in sections:
            raise ConfigError(f"--help {section}: no such config section; sections: {', '.join(sections)}")
        sections = [section]
    lines = [USAGE, ""]
    for name in sections:
        lines.append(f"[{name}]")
        for key, facts in keys.items():
            if key.split(".")[0] == name:
                refused = f" [only the default: {facts.refused}]" if facts.refused else ""
                inert = f" [no effect: {facts.inert}]" if facts.inert else ""
                needs = f" [only with {facts.needs}]" if facts.needs else ""
                lines.append(f"  --{key} (default {_default(key)}): {facts.help}{refused}{inert}{needs}")
        lines.append("")
    return "\n".join(lines).rstrip()


def key_table() -> str:
    """The README's table of every key: where its name comes from and what Tessera does with it."""
    rows = ["| key | default | status |", "| --- | --- | --- |"]
    for key, facts in declared(JobConfig).items():
        status = f"refused unless default: {facts.refused}" if facts.refused else \
            f"accepted, no effect: {facts.inert}" if facts.inert else "works"
        if facts.origin in _ORIGIN_NOTES:
            status = f"{status} ({_ORIGIN_NOTES[facts.origin]})"
        rows.append(f"| `{key}` | `{_default(key)}` | {status.replace('|', '/')} |")
    return "\n".join(rows)


def _library_version(name: str) -> str:
    """From the pyproject.toml beside the imported code (a checkout, Bazel's runfiles), else
    from the installed distribution (pip install ./libs/<name>)."""
    spec = importlib.util.find_spec(f"tessera.{name}")  # found, not imported: torchao's import is slow and noisy
    if spec is None:
        return "missing"
    pyproject = Path(next(iter(spec.submodule_search_locations))).parents[1] / "pyproject.toml"
    if pyproject.is_file():
        with open(pyproject, "rb") as f:
            return tomllib.load(f)["project"]["version"]
    try:
        return importlib.metadata.version(f"tessera-{name}")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _git_commit() -> str:
    """The commit of the checkout the trainer's code comes from: Bazel names the workspace, else
    this file's real folder (Bazel's runfiles link into the checkout), wherever the cwd is."""
    where = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or str(Path(__file__).resolve().parent)
    # Read only: `describe --dirty` rewrites the index (under .git/index.lock) whenever a file's
    # stat changed, so every run wrote into the checkout and could fail a git command running
    # there; `status` leaves the index alone when optional locks are off.
    git = lambda *args: subprocess.run(["git", "-C", where, *args], capture_output=True, text=True, timeout=10,  # noqa: E731
                                       env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    try:
        commit, status = git("describe", "--always"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if commit.returncode != 0 or status.returncode != 0:
        return "unknown"
    return commit.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def version_text() -> str:
    import torch

    libraries = " ".join(f"{name} {_library_version(name)}" for name in LIBRARIES)
    return f"tessera trainer {TRAINER_VERSION} | libraries: {libraries} | torch {torch.__version__} | git {_git_commit()}"


if __name__ == "__main__":  # regenerates the README's key table
    print(key_table())
