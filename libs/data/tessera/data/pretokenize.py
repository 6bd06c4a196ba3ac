"""Text sources -> token shards, tokenised by worker processes (the engine of tools/pretokenize).

Documents are read in order by this process, sent in batches to `workers` processes that encode
them (BOS + text + EOS, the loader's rule) and come back in order, so the shards hold the
documents in exactly the order the text path reads them. Everything is written into a temporary
sibling folder that is renamed into place at the end: the output folder is either absent or
complete. The index records what it was made from (files with size and mtime, text field,
tokenizer, shard size): re-running on the same inputs is a no-op, on other inputs an error.
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from tessera.data.datasets import iter_documents, source_files
from tessera.data.shards import ShardWriter, is_shard_folder, open_shards, token_dtype
from tessera.data.tokenizer import Tokenizer, load_tokenizer

# ~1 MB of text per task: large enough that pickling and queueing are noise, small enough that
# the workers stay busy and in-flight memory stays small.
_BATCH_CHARS = 1 << 20
DEFAULT_SHARD_TOKENS = 1 << 30

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str | None) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_batch(documents: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """Tokens of the batch end to end (in the shard dtype: less to pickle), each document's
    length, and the batch's UTF-8 size."""
    dtype = token_dtype(_worker_tokenizer.vocab_size)
    encoded = [np.asarray(_worker_tokenizer.encode(doc, bos=True, eos=True), dtype=dtype) for doc in documents]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    return np.concatenate(encoded), lengths, sum(len(doc.encode("utf-8")) for doc in documents)


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    batch, size = [], 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if size >= _BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _inputs(sources: list, text_field: str, tokenizer: Tokenizer, shard_tokens: int) -> dict:
    files = [p for source in sources for p in source_files(source)]
    return {
        "sources": [{"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                    for p in files],
        "text_field": text_field,
        "tokenizer": tokenizer.fingerprint,
        "shard_tokens": shard_tokens,
    }


def _remove_killed_runs(out: Path) -> None:
    """Deletes the partial outputs of runs into `out` on this host whose process is gone (killed
    before they could clean up): each is as large as the shards it had written. Another host's
    (or container's), or a live process's, are left alone."""
    prefix = f".{out.name}.tmp-{_this_host()}-"
    for tmp in out.parent.glob(f"{glob.escape(prefix)}*") if out.parent.is_dir() else ():
        pid = tmp.name[len(prefix):]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _this_host() -> str:
    """The host name and the PID namespace: containers sharing a host name (host networking) see
    neither each other's processes nor their pids' liveness."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux
        namespace = 0
    return f"{socket.gethostname()}-{namespace}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive all the same
        pass
    return True


def pretokenize(
    sources: list,
    out: str | os.PathLike,
    tokenizer_path: str | os.PathLike | None = None,
    text_field: str = "text",
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: Callable[[int, int, float], None] | None = None,
) -> dict:
    """Writes the documents of `sources` (as `load_dataset` reads them) as token shards in `out`.

    Returns the index. `progress(documents, text_bytes, seconds)` is called as batches land.
    Raises ValueError when `out` holds shards of other inputs, or the sources no documents.
    """
    if not sources:
        raise ValueError("pretokenize needs at least one source")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"shard_tokens must be a positive int, got {shard_tokens!r}")
    tokenizer = load_tokenizer(tokenizer_path)
    inputs = _inputs(sources, text_field, tokenizer, shard_tokens)
    out = Path(out)
    _remove_killed_runs(out)
    if out.exists():
        if is_shard_folder(out) and open_shards(out).index.get("inputs") == inputs:
            return open_shards(out).index
        raise ValueError(f"{out} exists and does not hold shards of these inputs; remove it or choose another folder")

    tmp = out.parent / f".{out.name}.tmp-{_this_host()}-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        writer = ShardWriter(tmp, token_dtype(tokenizer.vocab_size), shard_tokens)
        documents = text_bytes = 0
        start = time.perf_counter()
        path = None if tokenizer_path is None else os.fspath(tokenizer_path)
        with multiprocessing.get_context("fork").Pool(workers, _init_worker, (path,)) as pool:
            stream = (doc for source in sources for doc in iter_documents(source, text_field))
            for tokens, lengths, size in pool.imap(_encode_batch, _batches(stream)):
                writer.add(tokens, lengths)
                documents += len(lengths)
                text_bytes += size
                if progress is not None:
                    progress(documents, text_bytes, time.perf_counter() - start)
        if documents == 0:
            raise ValueError(f"sources {[str(s) for s in sources]} hold no documents")
        tok = {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
               "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
        index = writer.finish({"tokenizer": tok, "text_bytes": text_bytes, "inputs": inputs})
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index

