"""Pre-tokenise text into token shards for large runs (see libs/data/README.md, "Token shards").

    bazel run //tools/pretokenize -- corpus.jsonl.gz more_text/ --out data/shards --workers 8

Sources are read as `load_dataset` reads them (.txt/.md files, folders, .jsonl[.gz], .parquet,
`datasets` save_to_disk folders, "default").
Re-running on unchanged inputs is a no-op. Bad input ends as one `error:` line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tessera.data import pretokenize
from tessera.data.pretokenize import DEFAULT_SHARD_TOKENS


def _user_path(path: str) -> str:
    """Relative paths are the user's: `bazel run` changes the cwd and says where the user was."""
    if path == "default":
        return path
    return str(Path(os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd()) / os.path.expanduser(path))


def _progress(documents: int, text_bytes: int, seconds: float) -> None:
    seconds = max(seconds, 1e-9)
    print(f"\rpretokenize: {documents:,} docs, {text_bytes / 1e6:,.1f} MB | "
          f"{documents / seconds:,.0f} docs/s, {text_bytes / 1e6 / seconds:,.2f} MB/s", end="", file=sys.stderr,
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help="text files, folders, .jsonl[.gz] files or 'default'")
    parser.add_argument("--out", required=True, help="shard folder to create")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.model, tokenizer.json or a Hugging Face model folder (default: the bundled tokenizer)")
    parser.add_argument("--text-field", default="text", help="JSON field holding the document (default: text)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenising processes")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="most tokens per shard file")
    args = parser.parse_args(argv)
    shown = False  # a progress line is open on stderr (it ends with \r): later lines start on a new one

    def progress(*counts) -> None:
        nonlocal shown
        shown = True
        _progress(*counts)

    try:
        index = pretokenize(
            [_user_path(s) for s in args.sources], _user_path(args.out),
            tokenizer_path=args.tokenizer and _user_path(args.tokenizer), text_field=args.text_field,
            workers=args.workers, shard_tokens=args.shard_tokens, progress=progress,
        )
    except (ValueError, OSError) as e:
        print(("\n" if shown else "") + f"error: {e}", file=sys.stderr)
        return 2
    print(("\n" if shown else "") + f"{args.out}: {index['documents']:,} documents, {index['tokens']:,} tokens "
          f"({index['dtype']}) in {len(index['shards'])} shard(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
