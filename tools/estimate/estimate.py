"""usage: estimate [--job.config_file F] [--world_size N] [--formula] [--json] [--section.key value ...]

  --world_size N     ranks the job runs on (default 1)
  --formula          the closed form only, without the trace (Llama-shaped models)
  --json             the report as JSON instead of a table
  --section.key V    every override the trainer takes (its --job.config_file too), e.g.
                     --training.seq_len 4096; torchtitan's estimation switches
                     (--memory_estimation.enable true, --comm.mode fake_backend) as well
  -h, --help         this text

Per-rank memory (parameters, gradients, optimizer state, buffers, activations, peak), FLOPs and
bytes per collective kind and mesh dimension of one training step of the trainer's config, for
each distinct rank role, traced (fake tensors over a fake process group; see traced.py) and
closed-form side by side; `--formula` skips the trace. Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import json
import sys

from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.plan import JobPlan, make_plan

import formulas
import traced

GIB = 2**30
MEMORY = ("params", "grads", "optimizer", "buffers", "activations", "peak")


def _option(argv: list[str], name: str, flag: bool = False) -> tuple[str | None, list[str]]:
    """Removes `name` (with its value: `name V` or `name=V`) from argv: (value, rest), value ""
    for a flag, or (None, argv) when absent. A second one is refused here: left in the rest, the
    trainer's config reader would call it a malformed override."""
    found = [i for i, arg in enumerate(argv) if arg == name or (not flag and arg.startswith(name + "="))]
    if len(found) > 1:
        raise ConfigError(f"option {name} is given twice")
    if not found:
        return None, argv
    i = found[0]
    if flag or argv[i] != name:
        return argv[i].partition("=")[2], argv[:i] + argv[i + 1:]
    if i + 1 >= len(argv):
        raise ConfigError(f"option {name} needs a value")
    return argv[i + 1], argv[:i] + argv[i + 2:]


def estimate(plan: JobPlan, trace: bool = True) -> dict:
    """The report as a dict (what --json prints): one entry per rank role."""
    roles = []
    for rank, ranks in traced.rank_roles(plan):
        pp_rank = rank // (plan.world_size // plan.dims.pp)
        role = {"ranks": [ranks[0], ranks[-1]], "pp_rank": pp_rank, "flops_per_step": formulas.rank_flops(plan, pp_rank)}
        if formulas.covers(plan):
            formula = formulas.estimate_rank(plan, pp_rank)
            role.update(formula={k: getattr(formula, k) for k in MEMORY}, comm_bytes=_comm(formula.comm))
            if formula.host:
                role["host_offloaded"] = formula.host
        if trace:
            t = traced.trace_rank(plan, rank)
            measured = {k: getattr(t, k) for k in MEMORY}
            if not t.traced_activations:  # pipeline stage: formula activations over the traced model state
                state = sum(measured[k] for k in ("params", "optimizer", "buffers"))
                measured["activations"] = formula.activations
                measured["peak"] = max(t.peak, state + formula.peak - sum(getattr(formula, k) for k in ("params", "optimizer", "buffers")))
            else:
                role["comm_bytes"] = _comm(t.comm)
            role["traced"] = measured
            role["traced_activations"] = t.traced_activations
        roles.append(role)
    tokens = plan.batch.global_tokens
    return {
        "model": f"{plan.spec.name}/{plan.config.model.flavor}", "world_size": plan.world_size,
        "degrees": {k: v for k, v in plan.dims.degrees().items() if v > 1},
        "activation_checkpoint": plan.checkpointing.mode,
        "flops_per_token": plan.flops_per_token, "flops_per_step": plan.flops_per_token * tokens,
        "tokens_per_step": tokens, "roles": roles,
    }


def _comm(comm: dict[tuple[str, str], int]) -> dict[str, int]:
    return {f"{kind}/{dim}": n for (kind, dim), n in sorted(comm.items())}


def table(report: dict) -> str:
    degrees = " x ".join(f"{k} {v}" for k, v in report["degrees"].items()) or "single process"
    lines = [f"{report['model']} on {report['world_size']} rank(s) ({degrees}); AC {report['activation_checkpoint']}",
             f"FLOPs {report['flops_per_token']:.3e} per token, {report['flops_per_step']:.3e} per step "
             f"({report['tokens_per_step']:,} tokens)",
             f"{'ranks':>12} {'source':>8} " + " ".join(f"{k:>12}" for k in MEMORY) + "   (GiB)"]
    for role in report["roles"]:
        span = "{}-{}".format(*role["ranks"]) if role["ranks"][0] != role["ranks"][1] else str(role["ranks"][0])
        for source in ("traced", "formula"):
            if source in role:
                lines.append(f"{span:>12} {source:>8} " + " ".join(f"{role[source][k] / GIB:12.3f}" for k in MEMORY))
        if "host_offloaded" in role:
            lines.append(f"{'':>12} {'':>8} (activation offload: {role['host_offloaded'] / GIB:.3f} GiB of activations "
                         "in host memory, formula)")
        if role.get("traced_activations") is False:
            lines.append(f"{'':>12} {'':>8} (pipeline stage: activations from the formula)")
        lines.append(f"{'':>12} {'':>8} FLOPs {role['flops_per_step']:.3e} per rank per step; collectives per step: "
                     + (", ".join(f"{k} {v / GIB:.3f} GiB" for k, v in role["comm_bytes"].items()) or "none"))
    return "\n".join(lines)


# torchtitan's switches into its estimation / dry-run mode: this tool is that mode, so they are
# accepted here (and refused by the trainer, which points here)
ESTIMATOR_SWITCHES = frozenset({"memory_estimation.enable", "memory_estimation.disable_fake_mode", "comm.mode"})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:  # else the trainer's config reader takes it for an override
        print(__doc__.strip())
        return 0
    try:
        world, argv = _option(argv, "--world_size")
        as_json, argv = _option(argv, "--json", flag=True)
        formula_only, argv = _option(argv, "--formula", flag=True)
        if world is not None and (not world.isdigit() or int(world) < 1):
            raise ConfigError(f"--world_size {world!r} must be a positive integer")
        config = load_config(argv, accepted=ESTIMATOR_SWITCHES)
        if config.memory_estimation.disable_fake_mode:
            raise ConfigError("config key memory_estimation.disable_fake_mode: the estimator traces fake tensors only "
                              "(real ones would need the whole model's memory)")
        plan = make_plan(config, int(world or 1), "cuda", check_only=True, command_line=argv)
        if not formulas.covers(plan) and (formula_only is not None or plan.dims.pp > 1):
            raise ConfigError(f"model.name {plan.spec.name}: the closed form covers {', '.join(formulas.LLAMA_SHAPED)} only, "
                              "so this model is traced, without --formula and without pipeline parallel (its stages' "
                              "activations come from the closed form)")
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for what in plan.warnings:  # what the trainer's banner would say of this config
        print(f"warning: {what}", file=sys.stderr)
    report = estimate(plan, trace=formula_only is None)
    print(json.dumps(report, indent=1) if as_json is not None else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
