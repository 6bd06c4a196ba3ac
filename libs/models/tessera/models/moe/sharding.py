"""How an MoE layer is sharded, declared next to it (tessera.tp's roles, as data).

Tensor parallel, as torchtitan 0.2 lays it out: every TP rank routes all tokens (the layer is a
``partial_region``: its sequence-split input is gathered, its output is a partial sum over the
ranks, reduce-scattered back), the router runs whole on every rank (``local``), the routed
experts split on their hidden features (``experts``: w1/w3's rows, w2's columns, declared by
``GroupedExperts.tp_shard_dims``; a run whose expert parallel takes the experts whole gives
that role no style), the shared experts colwise (from the layer's share: ``partial_colwise``,
which no converter replaces) then rowwise into the same partial sum.
Routing is identical on every TP rank, so expert loads count each token once without any TP
reduction; the sequence-wise balance loss is whole on every rank, which ``set_aux_loss_scale``
divides by the TP degree.
"""


def moe_tp_plan(prefix: str, shared_experts: bool = True) -> dict[str, str]:
    """The tensor-parallel plan entries of the MoE layers at ``prefix`` (e.g. "layers.*.moe"),
    with the shared experts' for a family that has them."""
    plan = {prefix: "partial_region", f"{prefix}.router.gate": "local", f"{prefix}.experts": "experts"}
    if shared_experts:
        plan.update({f"{prefix}.shared_experts.w1": "partial_colwise", f"{prefix}.shared_experts.w3": "partial_colwise",
                     f"{prefix}.shared_experts.w2": "rowwise_partial"})
    return plan
