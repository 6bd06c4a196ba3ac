"""Tensor (+ sequence, + loss) parallel training matches a single process step for step; the
layout costs one collective per block each way; tied weights and async TP are wired right."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel

from tessera.mesh import build_meshes, resolve_parallel_dims
from tessera.mesh.testing import run_on_ranks
from tessera.tp import ROLES, apply_tp, check_tp_degree, enable_async_tp, loss_parallel_context, resolve_plan

DIM, N_HEADS, N_KV_HEADS, VOCAB, FFN_HIDDEN, N_LAYERS = 32, 8, 4, 64, 64, 2
BATCH, SEQ, STEPS, SEED = 2, 8, 3, 0

# Follows the Tessera conventions: heads reshaped with -1, sub-modules take the hidden state as
# their only positional input, blocks in a ModuleDict.
PLAN = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention": "block_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "norm",
    "layers.*.feed_forward": "block_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
    "norm": "norm",
    "output": "vocab_output",
}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim, self.n_rep = DIM // N_HEADS, N_HEADS // N_KV_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x):
        bs, seqlen, _ = x.shape
        q, k, v = (w(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN_HIDDEN, bias=False)
        self.w2 = nn.Linear(FFN_HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN_HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(DIM), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class ToyLlama(nn.Module):
    def __init__(self, tie_embeddings=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(N_LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(model, loss_parallel=False):
    """STEPS AdamW steps on fixed batches: losses, grad norms, final full parameters."""
    batches = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(SEED))
    # Adam divides each gradient by its own running RMS, so an entry near zero turns fp32
    # reduction-order noise into an update of up to lr: lr 1e-3 keeps that under the 1e-5 bound.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grad_norms = [], []
    for tokens in batches:
        inputs, labels = tokens[:, :-1], tokens[:, 1:]  # labels stay plain and whole on every rank
        with loss_parallel_context(loss_parallel):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
        # By hand: without SP the grads mix DTensors (sharded weights) and plain tensors (norms).
        grad_norms.append(math.sqrt(sum(_full(p.grad).pow(2).sum().item() for p in model.parameters())))
        losses.append(_full(loss).item())
        optimizer.step()
        optimizer.zero_grad()
    params = {name: _full(p).detach().clone() for name, p in model.named_parameters()}
    return losses, grad_norms, params


def build(tie_embeddings=False):
    torch.manual_seed(SEED)
    return ToyLlama(tie_embeddings)


# (tp degree, sequence_parallel, loss_parallel, tie_embeddings)
CASES = [(tp, sp, lp, False) for tp in (4, 2) for sp in (True, False) for lp in (True, False)] + [(2, True, True, True)]


def _lists(result):
    # Tensors would travel by shared-memory handles that die with the worker: send lists.
    losses, norms, params = result
    return losses, norms, {name: p.tolist() for name, p in params.items()}


def _parity_runs(meshes):
    """Trains every case; TP 2 cases are shared out between the world's two TP 2 groups."""
    group = meshes[2]["dp_replicate"].get_local_rank()
    tp2_cases = [case for case in CASES if case[0] == 2][group::2]
    out = {}
    for case in [case for case in CASES if case[0] == 4] + tp2_cases:
        tp, sp, lp, tie = case
        model = apply_tp(build(tie), meshes[tp]["tp"], PLAN, sequence_parallel=sp, loss_parallel=lp)
        result = _lists(train(model, loss_parallel=lp))
        if meshes[tp]["tp"].get_local_rank() == 0:
            out[case] = result
    return out


def _collective_counts(tp_mesh):
    """{sequence_parallel: (forward counts, backward counts)} of one training step."""
    counts = {}
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(SEED))
    for sp in (True, False):
        model = apply_tp(build(), tp_mesh, PLAN, sequence_parallel=sp, loss_parallel=True)
        with loss_parallel_context(True):
            with CommDebugMode() as forward:
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            with CommDebugMode() as backward:
                loss.backward()
        counts[sp] = tuple(
            {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()} for mode in (forward, backward)
        )
    return counts


def _tie_mismatch_error(tp_mesh):
    plan = {path: role for path, role in PLAN.items() if path != "tok_embeddings"}
    try:
        apply_tp(build(tie_embeddings=True), tp_mesh, plan)
    except ValueError as error:
        return str(error)
    return "no error"


def _async_tp_wiring(tp_mesh):
    # No GPU here: claim "cuda" to check what the call switches on (the inductor pass and the
    # TP group's symmetric-memory registration); no CUDA work happens inside it.
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group

    enable_async_tp(tp_mesh, "cuda", compile_enabled=True)
    return inductor_config._micro_pipeline_tp, is_symm_mem_enabled_for_group(tp_mesh.get_group().group_name)


class _CountingColwise(ColwiseParallel):
    applied = 0

    def _apply(self, module, device_mesh):
        type(self).applied += 1
        return super()._apply(module, device_mesh)


def _injected_styles(tp_mesh):
    """A caller's factory replaces a role's style, and a role only the caller knows is accepted."""
    plan = {**PLAN, "layers.*.feed_forward.w1": "counted_colwise"}
    styles = {"counted_colwise": lambda layouts: _CountingColwise(), "colwise": lambda layouts: _CountingColwise()}
    model = build()
    colwise = sum(role in styles for role in resolve_plan(model, plan, styles.keys() | ROLES).values())
    apply_tp(model, tp_mesh, plan, styles=styles)
    return _CountingColwise.applied, colwise, isinstance(model.layers["0"].feed_forward.w1.weight, DTensor)


def _on_four_ranks(rank, world_size):
    """All distributed checks in one spawn (a spawn costs seconds). TP 4 uses the whole world;
    for TP 2 it splits into two independent TP groups."""
    meshes = {4: build_meshes(resolve_parallel_dims(world_size, tp=4), "cpu")}
    meshes[2] = build_meshes(resolve_parallel_dims(world_size, dp_replicate=2, tp=2), "cpu")
    out = {"parity": _parity_runs(meshes)}
    out["collectives"] = _collective_counts(meshes[4]["tp"])
    out["tie_mismatch"] = _tie_mismatch_error(meshes[4]["tp"])
    out["async_tp"] = _async_tp_wiring(meshes[4]["tp"])
    out["injected_styles"] = _injected_styles(meshes[4]["tp"])
    return out


@pytest.fixture(scope="module")
def distributed():
    ranks = run_on_ranks(_on_four_ranks, 4)
    results = dict(ranks[0], parity={})
    for rank_results in ranks:
        results["parity"].update(rank_results["parity"])
    return results


@pytest.fixture(scope="module")
def references():
    return {tie: train(build(tie)) for tie in (False, True)}


def _assert_matches(got, want, what):
    (losses, norms, params), (ref_losses, ref_norms, ref_params) = got, want
    for name, value, ref in (("loss", losses, ref_losses), ("grad norm", norms, ref_norms)):
        rel = max(abs(a - b) / abs(b) for a, b in zip(value, ref))
        assert rel <= 1e-5, f"{what}: {name} {value} vs reference {ref} (rel {rel:.1e})"
    assert params.keys() == ref_params.keys()
    worst = max((torch.tensor(params[n]) - ref_params[n]).abs().max().item() for n in params)
    assert worst <= 1e-5, f"{what}: params differ by {worst:.1e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "tp{}-sp{:d}-lossparallel{:d}-tied{:d}".format(*c))
def test_tp_matches_single_process(distributed, references, case):
    tp, sp, lp, tie = case
    check_tp_degree(tp, {"n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS, "vocab_size": VOCAB, "ffn_hidden": FFN_HIDDEN})
    what = f"tp={tp} sequence_parallel={sp} loss_parallel={lp} tied={tie}"
    _assert_matches(distributed["parity"][case], references[tie], what)


def test_one_collective_per_block_each_way(distributed):
    # Per step: the embedding, 2 per layer (attention, feed-forward), the output; loss parallel
    # adds 3 small all-reduces (max, sum of exps, target logit) to the forward.
    per_direction = 1 + 2 * N_LAYERS
    forward, backward = distributed["collectives"][True]
    assert forward == {"reduce_scatter_tensor": per_direction, "all_gather_into_tensor": per_direction, "all_reduce": 3}
    assert backward == {"reduce_scatter_tensor": per_direction, "all_gather_into_tensor": per_direction}
    forward, backward = distributed["collectives"][False]
    assert forward == {"all_reduce": per_direction + 3}
    # The embedding needs no input gradient; each block input and the output get one all-reduce.
    assert backward == {"all_reduce": per_direction}


def test_tied_weights_need_matching_roles(distributed):
    assert "tied parameters 'tok_embeddings.weight' and 'output.weight'" in distributed["tie_mismatch"]


def test_async_tp_turns_on_micro_pipelining_and_symmetric_memory(distributed):
    assert distributed["async_tp"] == (True, True)


def test_caller_supplied_styles_replace_and_add_roles(distributed):
    applied, colwise_modules, sharded = distributed["injected_styles"]
    assert applied == colwise_modules > 0 and sharded
