"""The chunked loss (training.loss_chunk_size) against the loss of the whole logits, on CPU at a
128k vocabulary, side by side in one run: forward + backward of a small Llama (the debug flavor
cut to --layers blocks, vocabulary --vocab), batch 1. Each (loss, seq_len) runs in a fresh
process, so its peak RSS is its own; the peak of live tensor bytes is counted at the dispatcher
too (tools/estimate's LiveBytes: storage, not allocator caching).

    bazel run //tools/bench:loss_bench -- [--seqs 2048,4096,8192] [--chunk 1024] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import resource
import time

import torch
from fresh_process import run_in_fresh_process


def run_case(chunk: int, seq_len: int, steps: int, layers: int, vocab: int) -> dict:
    """One (chunk or 0 for the whole logits, seq_len): seconds per step after the first, tokens/s,
    peak RSS growth and the peak of the tensor bytes the step creates (weights excluded)."""
    from live_bytes import LiveBytes

    from tessera.models.llama import Transformer, llama3_flavors
    from tessera.trainer.chunked_loss import ChunkedCrossEntropy, defer_output
    from tessera.trainer.step import cross_entropy

    torch.manual_seed(0)
    args = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=layers, vocab_size=vocab, max_seq_len=seq_len)
    model = Transformer(args)
    loss_fn = cross_entropy
    if chunk:
        defer_output(model)
        loss_fn = ChunkedCrossEntropy(chunk, gather_logits=True)
        loss_fn.bind([model])
    tokens = torch.randint(1, vocab, (1, seq_len + 1))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, live = [], LiveBytes()
    for step in range(steps):
        start = time.perf_counter()
        with live if step == 0 else contextlib.nullcontext():  # counting slows the step it counts
            loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    seconds = min(times[1:] or times)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"chunk": chunk, "seq_len": seq_len, "s_per_step": seconds, "tokens_per_s": seq_len / seconds,
            "growth_gib": (peak - before) / 2**20, "live_peak_gib": live.peak / 2**30}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="2048,4096,8192")
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the chunked loss")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--steps", type=int, default=2, help="forward+backward steps per case; the fastest after the first counts")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child process: chunk,seq_len
    args = parser.parse_args(argv)
    if args.case:
        chunk, seq = args.case.split(",")
        print(json.dumps(run_case(int(chunk), int(seq), args.steps, args.layers, args.vocab)))
        return
    print(f"loss fwd+bwd, llama3 debugmodel x{args.layers} blocks, vocab {args.vocab:,}, batch 1, chunks of "
          f"{args.chunk} tokens, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'seq':>6} | {'whole logits: s/step':>20} {'tok/s':>7} {'RSS +GiB':>8} {'live GiB':>8} | "
          f"{'chunked: s/step':>15} {'tok/s':>7} {'RSS +GiB':>8} {'live GiB':>8} | {'speed':>6} {'memory':>7}")
    for seq in (int(s) for s in args.seqs.split(",")):
        rows = {}
        for chunk in (0, args.chunk):
            rows[chunk] = run_in_fresh_process(__file__, ["--case", f"{chunk},{seq}", "--steps", str(args.steps),
                                                          "--layers", str(args.layers), "--vocab", str(args.vocab)],
                                               f"{seq}: chunk {chunk}")
        whole, chunked = rows[0], rows[args.chunk]
        if whole is None or chunked is None:
            continue
        print(f"{seq:>6} | {whole['s_per_step']:>20.2f} {whole['tokens_per_s']:>7.0f} {whole['growth_gib']:>8.2f} "
              f"{whole['live_peak_gib']:>8.2f} | {chunked['s_per_step']:>15.2f} {chunked['tokens_per_s']:>7.0f} "
              f"{chunked['growth_gib']:>8.2f} {chunked['live_peak_gib']:>8.2f} | "
              f"{chunked['tokens_per_s'] / whole['tokens_per_s']:>5.2f}x "
              f"{whole['live_peak_gib'] / max(chunked['live_peak_gib'], 1e-3):>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
