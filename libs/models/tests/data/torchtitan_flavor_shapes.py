"""Writes torchtitan_flavor_shapes.json: each of torchtitan 0.2.2's model flavors as data (its
parameter count and how many parameters it has of each shape, a shape's sizes sorted so a
transposed layout counts the same), which test_torchtitan_flavors compares with Tessera's
flavors of the same names. Run it under the torchtitan peer's interpreter
(../shared/peer-torchtitan/setup.sh), from the repository root:
    $PEER_ROOT/venv022/bin/python libs/models/tests/data/torchtitan_flavor_shapes.py
It builds every flavor on the meta device, so it needs no memory to speak of."""

import collections
import importlib
import json
from pathlib import Path

import torch

# family -> (torchtitan module, its dict of flavors)
FAMILIES = {"llama3": ("torchtitan.models.llama3", "llama3_args"),
            "deepseek_v3": ("torchtitan.models.deepseek_v3", "deepseekv3_args"),
            "qwen3": ("torchtitan.models.qwen3", "qwen3_args"),
            "gpt_oss": ("torchtitan.models.gpt_oss", "gptoss_configs"),
            "llama4": ("torchtitan.models.llama4", "llama4_args")}


def flavor_shapes(model: torch.nn.Module) -> dict:
    shapes = collections.Counter("x".join(map(str, sorted(p.shape))) for p in model.parameters())
    return {"parameters": sum(p.numel() for p in model.parameters()), "shapes": dict(sorted(shapes.items()))}


def main() -> None:
    import torchtitan
    out = {"torchtitan": torchtitan.__version__}
    for family, (module, flavors) in FAMILIES.items():
        package = importlib.import_module(module)
        model_cls = package.get_train_spec().model_cls
        out[family] = {}
        for flavor, args in getattr(package, flavors).items():
            if not hasattr(args, "moe_impl"):  # DeepSeek-V3's is set from the job config
                args.moe_impl = "standard"
            with torch.device("meta"):
                out[family][flavor] = flavor_shapes(model_cls(args))
    path = Path(__file__).with_suffix(".json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
