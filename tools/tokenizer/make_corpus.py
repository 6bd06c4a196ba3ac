"""Write the embedded default corpus: a snapshot of this interpreter's standard-library source.

The output is gzip'd JSON lines, {"text": ...}, one document per `.py` file. The result depends
only on the stdlib files (sorted list, fixed selection rule, gzip header without time or name),
so re-running on the same Python build reproduces it byte for byte. The snapshot is committed;
the library never reads the local stdlib.

    python tools/tokenizer/make_corpus.py      # or: bazel run //tools/tokenizer:make_corpus
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import sysconfig
from pathlib import Path

# Tests and GUI code are skipped: tests repeat the library's own text, and the GUI folders are
# absent from some Python builds.
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "tkinter", "turtledemo", "site-packages",
                       "__pycache__"})
DEFAULT_MAX_BYTES = 6 * 1024 * 1024  # 6 MiB
DEFAULT_OUT = "libs/data/tessera/data/assets/stdlib_corpus.jsonl.gz"


def stdlib_sources(root: Path) -> list[tuple[str, str]]:
    """(path, text) of every non-blank UTF-8 `.py` file under `root` outside SKIP_DIRS, sorted."""
    sources = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            sources.append((rel.as_posix(), text))
    return sorted(sources)


def select(sources: list[tuple[str, str]], max_bytes: int) -> list[tuple[str, str]]:
    """Every k-th source for the smallest k that keeps the UTF-8 total within max_bytes.

    A stride instead of a prefix keeps the sample spread over the whole library.
    """
    for stride in range(1, len(sources) + 1):
        chosen = sources[::stride]
        if sum(len(text.encode("utf-8")) for _, text in chosen) <= max_bytes:
            return chosen
    raise ValueError(f"no stdlib file fits in {max_bytes} bytes")


def write_corpus(texts: list[str], out: Path) -> None:
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                               compresslevel=9, mtime=0) as f:
        for text in texts:
            f.write((json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8"))


def repo_path(relative: str) -> Path:
    # Under `bazel run` the working directory is the runfiles tree; write into the workspace.
    root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or Path(__file__).resolve().parents[2]
    return Path(root) / relative


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    args = parser.parse_args(argv)
    out = args.out or repo_path(DEFAULT_OUT)

    root = Path(sysconfig.get_paths()["stdlib"])
    chosen = select(stdlib_sources(root), args.max_bytes)
    write_corpus([text for _, text in chosen], out)
    raw_bytes = sum(len(text.encode("utf-8")) for _, text in chosen)
    print(f"{out}: {len(chosen)} documents from {root} (Python {sys.version.split()[0]}), "
          f"{raw_bytes / 1e6:.2f} MB raw, {out.stat().st_size / 1e6:.2f} MB gzip")
    return 0


if __name__ == "__main__":
    sys.exit(main())
