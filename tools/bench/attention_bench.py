"""Block-causal training on CPU at long sequences: the dense-mask path Tessera had (SDPA given a
[batch, 1, seq, seq] boolean mask) against the blocked kernel (tessera.models.blocked_attention),
side by side in one run. Each (path, seq_len) runs in a fresh process, so its peak RSS is its
own: a small Llama (the debug flavor cut to --layers blocks), local batch 1, packed documents
of --doc_len tokens, forward + backward.

    bazel run //tools/bench:attention_bench -- [--seqs 4096,8192,16384] [--steps 2] [--layers 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import time

import torch
import torch.nn.functional as F
from fresh_process import run_in_fresh_process


def _dense_document_attention(q, k, v, batch=None):
    """The old path: one [batch, 1, seq, seq] boolean mask, block-causal, handed to SDPA."""
    from tessera.mesh import repeat_kv_heads

    documents, seq = batch.documents, q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    mask = (documents[:, :, None] == documents[:, None, :])[:, None] & causal
    k, v = repeat_kv_heads(k, q.shape[1]), repeat_kv_heads(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def run_case(path: str, seq_len: int, steps: int, layers: int, doc_len: int) -> dict:
    """One (path, seq_len): seconds per step after the first, tokens/s, peak RSS over the start."""
    from tessera.models import inner_attentions
    from tessera.models.llama import Transformer, llama3_flavors

    torch.manual_seed(0)
    args = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=layers, vocab_size=2048, max_seq_len=seq_len)
    model = Transformer(args)
    if path == "dense":
        for layer in model.layers.values():
            layer.attention.inner_attention.forward = _dense_document_attention
    else:
        for inner in inner_attentions(model):
            inner.kernel = "blocked"
    tokens = torch.randint(1, args.vocab_size, (1, seq_len))
    documents = (torch.arange(seq_len) // doc_len)[None]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(tokens, document_ids=documents)
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        del logits
    seconds = min(times[1:] or times)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"path": path, "seq_len": seq_len, "s_per_step": seconds, "tokens_per_s": seq_len / seconds,
            "peak_rss_gib": peak / 2**20, "growth_gib": (peak - before) / 2**20}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,8192,16384")
    parser.add_argument("--steps", type=int, default=2, help="forward+backward steps per case; the fastest after the first counts")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--doc_len", type=int, default=1024, help="tokens per packed document")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child process: path,seq_len
    args = parser.parse_args(argv)
    if args.case:
        path, seq = args.case.split(",")
        print(json.dumps(run_case(path, int(seq), args.steps, args.layers, args.doc_len)))
        return
    print(f"block-causal fwd+bwd, llama3 debugmodel x{args.layers} blocks, batch 1, documents of {args.doc_len} tokens, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'seq':>6} | {'dense mask: s/step':>18} {'tok/s':>7} {'RSS +GiB':>8} | {'blocked: s/step':>15} {'tok/s':>7} "
          f"{'RSS +GiB':>8} | {'speed':>6} {'memory':>7}")
    for seq in (int(s) for s in args.seqs.split(",")):
        rows = {}
        for path in ("dense", "blocked"):
            rows[path] = run_in_fresh_process(__file__, ["--case", f"{path},{seq}", "--steps", str(args.steps),
                                                         "--layers", str(args.layers), "--doc_len", str(args.doc_len)],
                                              f"{seq}: {path}")
        dense, blocked = rows["dense"], rows["blocked"]
        if dense is None or blocked is None:
            continue
        print(f"{seq:>6} | {dense['s_per_step']:>18.2f} {dense['tokens_per_s']:>7.0f} {dense['growth_gib']:>8.2f} | "
              f"{blocked['s_per_step']:>15.2f} {blocked['tokens_per_s']:>7.0f} {blocked['growth_gib']:>8.2f} | "
              f"{dense['s_per_step'] / blocked['s_per_step']:>5.2f}x {dense['growth_gib'] / max(blocked['growth_gib'], 1e-3):>6.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
