"""Data benchmark, all figures measured side by side in this one run (prints, asserts nothing):

1. pretokenize throughput (MB/s of text, docs/s) of the embedded corpus, 1 vs 2 workers;
2. tokens/s served from shards (shuffled, as training reads them) vs tokens/s the trainer
   consumes on the debug model, and their ratio (goal: >= 20x);
3. resident memory while streaming a dataset 10x the embedded corpus, sampled along the way,
   and time to first batch for 1x vs 10x;
4. open time of a synthetic 2 GB token shard (and its first batch);
5. tokens/s each source serves, tokenising as it goes (text, Parquet, datasets folder) or not
   (shards), shuffled.

  bazel run //tools/pretokenize:bench_data -- [--workdir /tmp/bench_data] [--train-steps 8]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from tessera.data import build_dataloader, load_dataset, load_tokenizer, open_shards, pretokenize
from tessera.data.shards import ShardWriter
from tessera.trainer.config import load_config
from tessera.trainer.train import train

SEQ_LEN, BATCH = 256, 8  # the trainer's defaults (debug model)


def rss_mib() -> dict[str, float]:
    """Resident memory of this process (anonymous and file-backed) from /proc, in MiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def bench_pretokenize(work: Path) -> Path:
    print("1. pretokenize the embedded corpus (5.52 MB, 318 docs)")
    for workers in (1, 2):
        out = work / f"corpus_w{workers}"
        start = time.perf_counter()
        index = pretokenize(["default"], out, workers=workers)
        seconds = time.perf_counter() - start
        print(f"   {workers} worker(s): {seconds:6.2f} s  {index['text_bytes'] / 1e6 / seconds:6.2f} MB/s  "
              f"{index['documents'] / seconds:6.1f} docs/s  ({index['tokens']:,} tokens)")
    return work / "corpus_w2"


def loader_tokens_per_s(data, tok, batches: int) -> float:
    loader = build_dataloader(data, tok, SEQ_LEN, BATCH, shuffle=True)
    next(loader)
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return batches * BATCH * SEQ_LEN / (time.perf_counter() - start)


def bench_loader_vs_trainer(shards: Path, steps: int, work: Path) -> None:
    tok = load_tokenizer()
    served = loader_tokens_per_s(open_shards(shards), tok, 500)
    history = train(load_config(["--training.steps", str(steps), "--metrics.log_freq", "1", "--training.dataset_path",
                                 str(shards), "--job.dump_folder", str(work / "train"),
                                 "--metrics.disable_color_printing", "true"]))
    consumed = float(np.median([h["tps"] for h in history[1:]]))
    print(f"2. loader from shards: {served:,.0f} tokens/s | trainer (debug model, batch {BATCH}x{SEQ_LEN}, CPU): "
          f"{consumed:,.0f} tokens/s | ratio {served / consumed:,.0f}x")


def replicate(shards: Path, out: Path, times: int) -> Path:
    """`times` copies of the corpus documents as one shard set (a bigger dataset, same tokenizer)."""
    data = open_shards(shards)
    out.mkdir()
    writer = ShardWriter(out, data.dtype, 1 << 30)
    docs = [data.document(i) for i in range(len(data))]
    tokens, lengths = np.concatenate(docs), np.array([len(d) for d in docs])
    for _ in range(times):
        writer.add(tokens, lengths)
    writer.finish({k: data.index[k] for k in ("tokenizer", "text_bytes", "inputs")})
    return out


def first_batch_s(folder: Path, tok) -> float:
    start = time.perf_counter()
    next(build_dataloader(open_shards(folder), tok, SEQ_LEN, BATCH, shuffle=True))
    return time.perf_counter() - start


def bench_memory(shards: Path, work: Path) -> None:
    tok = load_tokenizer()
    big = replicate(shards, work / "corpus_x10", 10)
    ttfb = first_batch_s(shards, tok), first_batch_s(big, tok)
    data = open_shards(big)
    loader = build_dataloader(data, tok, SEQ_LEN, BATCH, shuffle=True, infinite=False)
    batches = data.num_tokens // ((SEQ_LEN + 1) * BATCH)
    samples = []
    start = time.perf_counter()
    for i, _ in enumerate(loader):
        if i % (batches // 4) == 0:
            samples.append((i, rss_mib()))
    seconds = time.perf_counter() - start
    print(f"3. streaming 10x corpus ({data.num_tokens:,} tokens, {batches:,} batches, one epoch, shuffled) in "
          f"{seconds:.1f} s:")
    for i, rss in samples:
        print(f"   batch {i:6,}: RSS {rss['VmRSS']:7.1f} MiB (anon {rss['RssAnon']:7.1f}, file {rss['RssFile']:6.1f})")
    print(f"   time to first batch: 1x {ttfb[0] * 1e3:.1f} ms, 10x {ttfb[1] * 1e3:.1f} ms")


def bench_2gb_shard(work: Path) -> None:
    """1 Gi uint16 tokens (2 GiB) in documents of 1000 tokens, written by the benchmark."""
    tok = load_tokenizer()
    folder = work / "synthetic_2gb"
    folder.mkdir()
    doc = np.random.default_rng(0).integers(0, tok.vocab_size, 1000).astype(np.uint16)
    doc[0], doc[-1] = tok.bos_id, tok.eos_id
    chunk = np.tile(doc, 64 * 1024)  # 64 Mi tokens
    writer = ShardWriter(folder, np.dtype("<u2"), 1 << 31)
    lengths = np.full(64 * 1024, 1000)
    for _ in range(16):  # 16 x 64 Mi tokens = 1 Gi tokens
        writer.add(chunk, lengths)
    writer.finish({"tokenizer": {"name": tok.name, "fingerprint": tok.fingerprint}, "text_bytes": 0, "inputs": {}})
    size = (folder / "shard-00000.tokens").stat().st_size
    start = time.perf_counter()
    data = open_shards(folder)
    opened = time.perf_counter() - start
    next(build_dataloader(data, tok, SEQ_LEN, BATCH, shuffle=True))
    first = time.perf_counter() - start
    print(f"4. synthetic shard of {size / 2**30:.2f} GiB ({data.num_tokens:,} tokens): open {opened * 1e3:.1f} ms, "
          f"open + first shuffled batch {first * 1e3:.1f} ms")


def bench_sources(shards: Path, work: Path) -> None:
    """The embedded corpus as each source kind: its JSON lines, Parquet files of 64-row groups
    (pyarrow, when installed), a `datasets` save_to_disk folder (datasets, when installed) and
    its token shards."""
    tok = load_tokenizer()
    sources = {"text (.jsonl.gz)": load_dataset(), "token shards": open_shards(shards)}
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        (work / "parquet").mkdir()
        pq.write_table(pa.table({"text": list(sources["text (.jsonl.gz)"])}), work / "parquet" / "corpus.parquet",
                       row_group_size=64)
        sources["Parquet"] = load_dataset(work / "parquet")
    except ImportError:
        print("   (Parquet skipped: pyarrow is not installed)")
    try:
        import datasets

        datasets.Dataset.from_dict({"text": list(sources["text (.jsonl.gz)"])}).save_to_disk(str(work / "saved"))
        sources["datasets folder"] = load_dataset(work / "saved")
    except ImportError:
        print("   (datasets folder skipped: datasets is not installed)")
    print("5. tokens/s served by each source (shuffled, tokenising where the source is text):")
    for name, data in sources.items():
        print(f"   {name:18} {loader_tokens_per_s(data, tok, 200):12,.0f} tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="scratch folder (default: the system's temporary one)")
    parser.add_argument("--train-steps", type=int, default=8)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_data_", dir=args.workdir))  # holds ~2.1 GB; removed at the end
    try:
        shards = bench_pretokenize(work)
        bench_loader_vs_trainer(shards, args.train_steps, work)
        bench_memory(shards, work)
        bench_2gb_shard(work)
        bench_sources(shards, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
