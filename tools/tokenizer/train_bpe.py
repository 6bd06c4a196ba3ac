"""Train byte-level BPE ranks on a dataset and write them as a Llama 3 `tokenizer.model` file.

Text is pre-split with the Llama 3 pattern; merges are counted over the table of distinct
pieces and their frequencies, with pair counts updated incrementally after each merge. Ties go
to the pair of smallest (left id, right id), so the output is the same on every run.

    python tools/tokenizer/train_bpe.py    # or: bazel run //tools/tokenizer:train_bpe
rewrites libs/data/tessera/data/assets/tokenizer.model from the embedded corpus.
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable

import regex

from tessera.data.datasets import load_dataset
from tessera.data.tokenizer import LLAMA3_SPLIT_PATTERN, write_ranks

DEFAULT_MERGES = 1536  # 256 byte tokens + 1536 merges + 256 specials = vocabulary of 2048
DEFAULT_OUT = "libs/data/tessera/data/assets/tokenizer.model"


def count_pieces(documents: Iterable[str]) -> Counter[bytes]:
    """UTF-8 bytes of every pre-split piece -> number of occurrences."""
    split = regex.compile(LLAMA3_SPLIT_PATTERN)
    counts: Counter[bytes] = Counter()
    for doc in documents:
        counts.update(piece.encode("utf-8") for piece in split.findall(doc))
    return counts


def train_bpe(piece_counts: dict[bytes, int], num_merges: int) -> dict[bytes, int]:
    """Ranks of the 256 single bytes followed by `num_merges` merged tokens, in merge order."""
    vocab = [bytes([b]) for b in range(256)]
    pieces = sorted(piece_counts)
    words = [list(piece) for piece in pieces]  # each piece as a list of token ids
    freqs = [piece_counts[piece] for piece in pieces]

    pair_count: dict[tuple[int, int], int] = defaultdict(int)
    pair_words: dict[tuple[int, int], set[int]] = defaultdict(set)  # may hold stale entries
    for w, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_count[pair] += freq
            pair_words[pair].add(w)
    # Max-heap by count, then smallest pair; entries whose count is outdated are skipped.
    heap = [(-count, pair) for pair, count in pair_count.items()]
    heapq.heapify(heap)

    while len(vocab) < 256 + num_merges:
        while heap and pair_count.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        if not heap:
            raise ValueError(f"corpus too small: only {len(vocab) - 256} merges possible")
        _, (left, right) = heapq.heappop(heap)
        # No earlier token has these bytes: a span of bytes whose tokens never cross its edges is
        # merged the same way in every word, so a merge never recreates an existing token.
        new_id = len(vocab)
        vocab.append(vocab[left] + vocab[right])

        touched = set()
        for w in pair_words.pop((left, right)):
            word, freq = words[w], freqs[w]
            new_word = _merge(word, left, right, new_id)
            if len(new_word) == len(word):
                continue  # stale entry: an earlier merge removed the pair from this word
            change: dict[tuple[int, int], int] = defaultdict(int)
            for pair in zip(word, word[1:]):
                change[pair] -= 1
            for pair in zip(new_word, new_word[1:]):
                change[pair] += 1
            for pair, delta in change.items():
                if delta:
                    pair_count[pair] += delta * freq
                    touched.add(pair)
                    if delta > 0:
                        pair_words[pair].add(w)
            words[w] = new_word
        for pair in touched:
            if pair_count[pair] > 0:
                heapq.heappush(heap, (-pair_count[pair], pair))
            else:
                del pair_count[pair]
    return {token: rank for rank, token in enumerate(vocab)}


def _merge(word: list[int], left: int, right: int, new_id: int) -> list[int]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def repo_path(relative: str) -> Path:
    # Under `bazel run` the working directory is the runfiles tree; write into the workspace.
    root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or Path(__file__).resolve().parents[2]
    return Path(root) / relative


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="default",
                        help="dataset for tessera.data.load_dataset (default: embedded corpus)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--merges", type=int, default=DEFAULT_MERGES)
    parser.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    out = args.out or repo_path(DEFAULT_OUT)

    start = time.perf_counter()
    try:
        counts = count_pieces(load_dataset(args.corpus, args.text_field))
        counted = time.perf_counter()
        ranks = train_bpe(counts, args.merges)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    write_ranks(ranks, out)
    done = time.perf_counter()
    print(f"{out}: {len(ranks)} ranks ({args.merges} merges) from {len(counts)} distinct pieces; "
          f"counting {counted - start:.1f}s, merging {done - counted:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
