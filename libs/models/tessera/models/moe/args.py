"""Hyper-parameters of a mixture-of-experts feed-forward layer."""

from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs:
    """Routed experts (SwiGLU, each ``hidden_dim`` wide) chosen per token by a top-k router, plus
    ``n_shared_experts`` always-on experts (one SwiGLU ``n_shared_experts * hidden_dim`` wide).

    Routing: scores = softmax or sigmoid of the gate logits (float32). The top ``top_k`` experts
    are chosen by ``scores + expert_bias``; with ``n_groups > 1`` only among the ``topk_groups``
    groups (of consecutive experts) ranked highest by the sum of their best ``group_score_top``
    choice scores (DeepSeek-V3: 2; DeepSeek-V2's group-limited greedy: 1, the group's maximum).
    The chosen experts' weights are their scores (without bias), divided by their sum when
    ``route_norm``, times ``route_scale`` (softmax scores renormalised over the chosen experts are
    the softmax of the chosen logits: GPT-OSS's routing). ``gate_bias``: the gate linear has a
    bias of its own (GPT-OSS), a learned part of the logits, unlike ``expert_bias``.
    ``score_before_experts``: each routed row is scaled by its weight before the expert runs and
    the expert outputs are summed unweighted (Llama 4; torchtitan's name), not weighted after.

    Balance: ``bias_update_rate`` is the step of auxiliary-loss-free balancing (DeepSeek-V3's
    gamma, 0: the bias is never updated); ``aux_loss_alpha`` weighs the sequence-wise balance loss
    (DeepSeek-V3's alpha; 0: off).
    """

    n_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256
    n_shared_experts: int = 0
    score_func: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    n_groups: int = 1
    topk_groups: int = 1
    group_score_top: int = 2
    bias_update_rate: float = 1e-3
    aux_loss_alpha: float = 0.0
    gate_bias: bool = False
    score_before_experts: bool = False

    def __post_init__(self):
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEArgs: score_func={self.score_func!r} is not one of {SCORE_FUNCS}")
        if self.n_experts % self.n_groups:
            raise ValueError(f"MoEArgs: n_experts={self.n_experts} is not divisible by n_groups={self.n_groups}")
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(f"MoEArgs: topk_groups={self.topk_groups} is not in 1..n_groups={self.n_groups}")
        per_group = self.n_experts // self.n_groups
        if self.n_groups > 1 and not 1 <= self.group_score_top <= per_group:
            raise ValueError(f"MoEArgs: group_score_top={self.group_score_top} is not in "
                             f"1..{per_group} (experts per group)")
        if not 1 <= self.top_k <= self.topk_groups * per_group:
            raise ValueError(f"MoEArgs: top_k={self.top_k} is not in 1..{self.topk_groups * per_group} "
                             "(the experts of topk_groups groups)")
