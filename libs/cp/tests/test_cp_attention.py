"""Context-parallel attention against full-sequence SDPA in one process: outputs and dQ/dK/dV of
every rank's tokens equal to fp32 rounding, for cp 2 and 4, with and without load balancing,
with grouped-query K/V (half as many heads as Q: only those travel) — for the all-gather-KV
exchange (every mask: documents, windows, chunks, sinks) and for torch's ring with either rotation."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.cp import KVGather, RingAttention, check_seq_len, local_positions
from tessera.mesh.testing import run_on_ranks

B, H, T, D = 2, 4, 16, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g)
    kv = torch.randn(2, B, H // 2, T, D, generator=g)  # GQA: 2 K/V heads, each serving 2 query heads
    return q, kv[0], kv[1]


def _reference():
    q, k, v = (t.clone().requires_grad_() for t in _inputs())
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True)
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad, k.grad, v.grad


def _gathered(group, load_balance, mask=None):
    """A model's inner attention with the all-gather-KV exchange (what apply_cp sets)."""
    from tessera.models import AttentionMask, InnerAttention

    inner = InnerAttention(mask or AttentionMask())
    inner.context_parallel = KVGather(group, load_balance)
    return inner


KERNELS = {"allgather_kv": _gathered, "ring_alltoall": lambda group, balance: RingAttention(group, "alltoall", balance).attend,
           "ring_allgather": lambda group, balance: RingAttention(group, "allgather", balance).attend}


def _cp_rank(rank, world_size, load_balance):
    """Every kernel of KERNELS on this rank's shard, in one set of processes."""
    positions = local_positions(T, world_size, rank, load_balance)
    results = {}
    for kernel in KERNELS:
        q, k, v = (t.index_select(2, positions).clone().requires_grad_() for t in _inputs())
        out = KERNELS[kernel](dist.group.WORLD, load_balance)(q, k, v)
        out.backward(torch.ones_like(out))
        results[kernel] = (positions, out.detach(), q.grad, k.grad, v.grad)
    return results


@pytest.mark.parametrize("cp, load_balance", [(2, True), (4, True), (2, False)])
def test_matches_full_sequence_attention(cp, load_balance):
    ref = _reference()
    for results in run_on_ranks(_cp_rank, cp, load_balance):
        for kernel, (positions, *got) in results.items():
            for name, value, full in zip(("out", "dq", "dk", "dv"), got, ref):
                torch.testing.assert_close(value, full.index_select(2, positions), rtol=1e-5, atol=1e-6, msg=f"{kernel} {name}")


def test_load_balanced_shards_hold_a_head_and_a_tail_chunk():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_positions(8, 2, 1, load_balance=False).tolist() == [4, 5, 6, 7]
    assert sorted(torch.cat([local_positions(16, 4, r) for r in range(4)]).tolist()) == list(range(16))


def test_seq_len_that_does_not_cut_is_named():
    with pytest.raises(ValueError, match=r"seq_len 12 does not divide into 8 = 2 \* context_parallel_degree"):
        check_seq_len(12, 4, load_balance=True)


def _saved_bytes(model, tokens, positions=None) -> int:
    """Activation bytes autograd keeps for backward (parameters left out)."""
    params = {p.data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        if tensor.data_ptr() not in params:
            seen[tensor.data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens, **({} if positions is None else {"positions": positions})).sum().backward()
    return sum(seen.values())


def _model():
    from dataclasses import replace

    from tessera.models.llama import Transformer, llama3_flavors

    torch.manual_seed(0)
    return Transformer(replace(llama3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=256))


def _activation_bytes(rank, world_size, rotate_method, gathered_kernel):
    from tessera.cp import apply_cp, shard_sequence

    tokens = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    model = _model()
    apply_cp(model, dist.group.WORLD, rotate_method=rotate_method, gathered_kernel=gathered_kernel)
    positions = local_positions(256, world_size, rank)
    return _saved_bytes(model, shard_sequence(tokens, positions), positions)


def test_activation_memory_per_rank_about_halves_at_cp2():
    whole = _saved_bytes(_model(), torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0)))
    gathered, ring, ring_gather = (run_on_ranks(_activation_bytes, 2, method, gathered_kernel) for method, gathered_kernel in
                                   (("allgather", True), ("alltoall", False), ("allgather", False)))
    for name, per_rank in (("all-gather-KV", gathered), ("ring alltoall", ring), ("ring allgather", ring_gather)):
        print(f"activation bytes kept for backward at seq 256: cp 1 {whole / 1024:.0f} KiB, cp 2 {name} "
              f"{[f'{b / 1024:.0f} KiB' for b in per_rank]} per rank ({max(per_rank) / whole:.2f}x)")
    # all-gather keeps the gathered K/V of the whole sequence for backward, so a bit more than half
    assert max(gathered) < 0.7 * whole
    # the ring keeps only the local K/V and the merged output's log-sum-exp, however K/V travel
    assert max(ring) < max(gathered) and max(ring) < 0.6 * whole
    assert max(ring_gather) < 0.6 * whole


def _documents():
    """Two sequences packing documents of uneven lengths (ids ascend along the sequence)."""
    starts = [[0, 3, 9], [0, 11]]
    ids = torch.zeros(B, T, dtype=torch.long)
    for row, row_starts in enumerate(starts):
        for start in row_starts[1:]:
            ids[row, start:] += 1
    return ids


MASKS = {"document": (None, True), "window": ({"window": 5}, False), "chunk+document": ({"chunk": 4}, True),
         "window+sinks": ({"window": 3}, False)}


def _masked(name, group=None, load_balance=True):
    """The model's inner attention with one of MASKS (sinks: fixed, uneven logits), alone or
    with the all-gather-KV exchange."""
    from tessera.models import AttentionMask, InnerAttention

    limits, _ = MASKS[name]
    inner = InnerAttention(AttentionMask(**(limits or {})), sinks=H if "sinks" in name else None)
    if inner.sinks is not None:
        with torch.no_grad():
            inner.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    if group is not None:
        inner.context_parallel = KVGather(group, load_balance)
    return inner


def _reference_masked(name):
    from tessera.models import AttentionBatch

    q, k, v = (t.clone().requires_grad_() for t in _inputs())
    inner = _masked(name)
    out = inner(q, k, v, AttentionBatch(_documents() if MASKS[name][1] else None))
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad, k.grad, v.grad, *([inner.sinks.grad] if inner.sinks is not None else [])


def _cp_rank_masked(rank, world_size, load_balance):
    """Every mask of MASKS on this rank's shard, in one set of processes."""
    from tessera.models import AttentionBatch

    positions = local_positions(T, world_size, rank, load_balance)
    results = {}
    for name in MASKS:
        q, k, v = (t.index_select(2, positions).clone().requires_grad_() for t in _inputs())
        inner = _masked(name, dist.group.WORLD, load_balance)
        documents = _documents().index_select(1, positions) if MASKS[name][1] else None
        out = inner(q, k, v, AttentionBatch(documents))
        out.backward(torch.ones_like(out))
        sinks = [inner.sinks.grad.clone()] if inner.sinks is not None else []
        for grad in sinks:  # a parameter's gradient is summed over the cp ranks, as FSDP's reduction does
            dist.all_reduce(grad)
        results[name] = (positions, out.detach(), q.grad, k.grad, v.grad, *sinks)
    return results


@pytest.mark.parametrize("load_balance", [True, False])
def test_every_mask_matches_full_sequence_attention_under_cp(load_balance):
    """The all-gather-KV exchange with the layer's own kernel: documents, windows, chunks and
    sinks give every rank's queries the whole sequence's outputs and gradients."""
    plain = _reference()
    by_rank = run_on_ranks(_cp_rank_masked, 2, load_balance)
    for name in MASKS:
        ref = _reference_masked(name)
        assert not torch.allclose(ref[0], plain[0]), name  # the mask changes the result
        for results in by_rank:
            positions, *got = results[name]
            for what, value, full in zip(("out", "dq", "dk", "dv"), got, ref):
                torch.testing.assert_close(value, full.index_select(2, positions), rtol=1e-5, atol=1e-6, msg=f"{name} {what}")
            if len(got) > 4:
                torch.testing.assert_close(got[4], ref[4], rtol=1e-5, atol=1e-6, msg=f"{name} d sinks")


def test_the_ring_refuses_a_mask_it_cannot_apply():
    from tessera.models import AttentionMask, InnerAttention

    inner = InnerAttention(AttentionMask(window=4))
    inner.context_parallel = RingAttention.__new__(RingAttention)  # no group needed to refuse
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="ring runs plain causal attention only, not causal \\+ window 4"):
        inner(q, k, v)
