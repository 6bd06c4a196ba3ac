"""The trainer's extension points, used from outside as another team would, with no edit to
apps/trainer: a model family registered from this file (not from tessera.models), whose layers
alternate sliding-window attention with attention sinks and global causal attention (tessera's
InnerAttention, the attention kinds declared in its spec) and whose MoE layers hold experts of
its own layout (gate and up projections interleaved in one tensor, as GPT-OSS stores them,
declaring their own tensor-parallel split), trains single process, under FSDP 2, TP 2 (sinks
split with the heads, experts on their declared dims), EP 2 and CP 2 (all-gather-KV, the window
applied to the whole sequence) with the same losses; a model converter registered here runs
before tensor parallel wraps the model and its post-optimizer hook runs after every step."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.mesh.testing import run_on_ranks
from tessera.models import CAUSAL, AttentionMask, InnerAttention, ModelSpec, register_model_spec
from tessera.models.attention import attention_batch
from tessera.models.moe import MoE, MoEArgs, moe_tp_plan
from tessera.trainer.config import load_config
from tessera.trainer.converters import ModelConverter, register_converter
from tessera.trainer.plan import make_plan
from tessera.trainer.train import train


@dataclasses.dataclass(frozen=True)
class ParallelGPTArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 2048  # the embedded tokenizer's ids: the flavor sizes the vocabulary
    max_seq_len: int = 64


WINDOW = AttentionMask(window=8)  # shorter than seq_len 32: the window changes what a query sees


def _layer_attention(layer_id: int) -> tuple[AttentionMask, bool]:
    """Even layers: a sliding window with attention sinks; odd layers: global causal."""
    return (WINDOW, True) if layer_id % 2 == 0 else (CAUSAL, False)


class SelfAttention(nn.Module):
    """Multi-head attention without position encoding (NoPE): causality alone orders tokens."""

    def __init__(self, args: ParallelGPTArgs, layer_id: int):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.qkv_q, self.qkv_k, self.qkv_v = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(3))
        self.proj = nn.Linear(args.dim, args.dim, bias=False)
        mask, sinks = _layer_attention(layer_id)
        self.inner_attention = InnerAttention(mask, sinks=args.n_heads if sinks else None)

    def forward(self, x: torch.Tensor, attention=None) -> torch.Tensor:
        bs, seq, _ = x.shape
        q, k, v = (lin(x).view(bs, seq, -1, self.head_dim).transpose(1, 2) for lin in (self.qkv_q, self.qkv_k, self.qkv_v))
        out = self.inner_attention(q, k, v, attention)
        return self.proj(out.transpose(1, 2).reshape(bs, seq, -1))


class MLP(nn.Module):
    def __init__(self, args: ParallelGPTArgs):
        super().__init__()
        self.fc_in = nn.Linear(args.dim, 4 * args.dim, bias=False)
        self.fc_out = nn.Linear(4 * args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


MOE = MoEArgs(n_experts=4, top_k=2, hidden_dim=32, bias_update_rate=0.0)


class InterleavedExperts(nn.Module):
    """The family's own experts (tessera's experts seam: rows grouped by expert, counts per expert,
    every parameter stacked on dim 0): gate and up projections interleaved column by column in
    one tensor, y = (silu(h[:, 0::2]) * h[:, 1::2]) @ down with h = x @ gate_up. Tensor parallel
    splits gate_up's columns (pairs stay together: each rank gets whole gate/up pairs) and
    down's rows, as declared here."""

    tp_shard_dims = {"gate_up": 2, "down": 1}

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden_dim))
        self.down = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.init_weights(0.02)

    def init_weights(self, init_std: float) -> None:
        nn.init.normal_(self.gate_up, std=0.02)
        nn.init.normal_(self.down, std=init_std)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(x.split(num_tokens_per_expert.tolist())):
            h = rows @ self.gate_up[e]
            outs.append((F.silu(h[:, 0::2]) * h[:, 1::2]) @ self.down[e])
        return torch.cat(outs)


def _moe(args: ParallelGPTArgs) -> MoE:
    layer = MoE(args.dim, MOE)
    layer.experts = InterleavedExperts(args.dim, MOE.hidden_dim, MOE.n_experts)
    return layer


class ParallelBlock(nn.Module):
    """GPT-J's parallel block: attention and MLP read the same normed input, x + attn(n) + ffn(n),
    the ffn a dense ``mlp`` on even layers and an MoE layer ``moe`` on odd ones."""

    def __init__(self, args: ParallelGPTArgs, layer_id: int):
        super().__init__()
        self.ln = nn.LayerNorm(args.dim, bias=False)
        self.attn = SelfAttention(args, layer_id)
        self.mlp = MLP(args) if layer_id % 2 == 0 else None
        self.moe = _moe(args) if layer_id % 2 == 1 else None

    def forward(self, x: torch.Tensor, *, attention=None) -> torch.Tensor:
        n = self.ln(x)
        ffn = self.mlp if self.mlp is not None else self.moe
        return x + self.attn(n, attention=attention) + ffn(n)


class ParallelGPT(nn.Module):
    def __init__(self, args: ParallelGPTArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): ParallelBlock(args, i) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim, bias=False)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self, buffer_device=None) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            elif isinstance(module, InnerAttention) and module.sinks is not None:
                nn.init.normal_(module.sinks)  # uneven sinks, so they matter from the first step
            elif isinstance(module, InterleavedExperts):
                module.init_weights(0.02)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """positions: given under context parallel (this rank's tokens); NoPE does not read them."""
        h = self.tok_embeddings(tokens)
        attention = attention_batch(self.layers, None, tokens.shape[1], h.device)
        for layer in self.layers.values():
            h = layer(h, attention=attention)
        return self.output(self.norm(h))


def _flops_per_token(args: ParallelGPTArgs, seq_len: int) -> float:
    per_layer = 4 * args.dim * args.dim + 8 * args.dim * args.dim
    return 6 * (args.n_layers * per_layer + args.dim * args.vocab_size) + 12 * args.n_layers * args.dim * seq_len


register_model_spec(ModelSpec(
    name="parallel_gpt",
    flavors={"tiny": ParallelGPTArgs()},
    build=ParallelGPT,
    flops_per_token=_flops_per_token,
    tp_plan={
        "tok_embeddings": "vocab_embedding",
        "layers.*.ln": "norm",
        "layers.*.attn": "block_input",
        "layers.*.attn.qkv_q": "colwise",
        "layers.*.attn.qkv_k": "colwise",
        "layers.*.attn.qkv_v": "colwise",
        "layers.*.attn.proj": "rowwise",
        "layers.*.attn.inner_attention": "local",
        "layers.*.mlp": "block_input",
        "layers.*.mlp.fc_in": "colwise",
        "layers.*.mlp.fc_out": "rowwise",
        **moe_tp_plan("layers.*.moe", shared_experts=False),  # tessera's MoE layer around the family's own experts
        "norm": "norm",
        "output": "vocab_output",
    },
    tp_divisible=lambda args: {"n_heads": args.n_heads, "vocab_size": args.vocab_size, "mlp": 4 * args.dim,
                               "expert hidden_dim": MOE.hidden_dim},
    n_experts=lambda args: MOE.n_experts,
    attention_kinds=lambda args: tuple(dict.fromkeys(_layer_attention(i) for i in range(args.n_layers))),
))


class MarkedLinear(nn.Linear):
    """What a quantising converter would put in; computes exactly what nn.Linear does."""


def _mark_linears(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                marked = MarkedLinear(child.in_features, child.out_features, bias=child.bias is not None)
                marked.load_state_dict(child.state_dict())
                setattr(parent, name, marked)


HOOK_CALLS: list[nn.Module] = []  # the model, once per optimizer step


def _count_steps(model: nn.Module) -> None:
    HOOK_CALLS.append(model)


register_converter("mark_linears", lambda config, dims, device: ModelConverter(
    "mark_linears", _mark_linears, post_optimizer_hooks=(_count_steps,),
))

STEPS = 3
BASE = ["--model.name", "parallel_gpt", "--model.flavor", "tiny", "--training.seq_len", "32",
        "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3"]
LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "cp2": ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "ep2": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"],
}


def _losses(argv):
    return [(h["loss"], h["grad_norm"]) for h in train(load_config(argv))]


def _rank(rank, world_size, argv):
    return _losses(argv)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    dump = tmp_path_factory.mktemp("single")
    return _losses([*BASE, "--training.local_batch_size", "4", "--job.dump_folder", str(dump)])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_family_registered_outside_trains_under_every_layout(tmp_path, reference, layout):
    local_batch = 2 if layout in ("fsdp2", "ep2") else 4
    plan = make_plan(load_config([*BASE, *LAYOUTS[layout], "--training.local_batch_size", str(local_batch)]), 2, "cpu")
    assert plan.attention.describe().startswith("causal + window 8 + sinks -> blocked; causal -> ")
    argv = [*BASE, *LAYOUTS[layout], "--training.local_batch_size", str(local_batch), "--job.dump_folder", str(tmp_path)]
    for rank_losses in run_on_ranks(_rank, 2, argv):
        for (loss, norm), (ref_loss, ref_norm) in zip(rank_losses, reference):
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert reference[-1][0] < reference[0][0]  # and it learns


def _converted_under_tp(rank, world_size, argv):
    losses = _losses(argv)
    model = HOOK_CALLS[-1]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return {
        "losses": losses,
        # a TP class swap (the router's) subclasses what it found: the converter's, when it came first
        "all_marked": all(isinstance(m, MarkedLinear) for m in linears),
        "sharded": type(model.layers["0"].attn.qkv_q.weight).__name__,
        "hook_calls": len(HOOK_CALLS),
    }


def test_converter_runs_before_tensor_parallel_and_hooks_after_each_step(tmp_path, reference):
    argv = [*BASE, *LAYOUTS["tp2"], "--training.local_batch_size", "4", "--model.converters", "mark_linears",
            "--job.dump_folder", str(tmp_path)]
    result = run_on_ranks(_converted_under_tp, 2, argv)[0]
    assert result["all_marked"] and result["sharded"] == "DTensor"
    assert result["hook_calls"] == STEPS
    for (loss, _), (ref_loss, _) in zip(result["losses"], reference):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert math.isfinite(result["losses"][-1][0])


def test_the_familys_attention_kinds_and_sink_names():
    model = ParallelGPT(ParallelGPTArgs())
    assert [name for name in model.state_dict() if "sinks" in name] == ["layers.0.attn.inner_attention.sinks"]
    declared = {(inner.mask, inner.sinks is not None) for inner in (layer.attn.inner_attention for layer in model.layers.values())}
    assert declared == {(WINDOW, True), (CAUSAL, False)}
