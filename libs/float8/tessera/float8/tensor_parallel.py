"""Tensor-parallel styles for float8 linears, supplied to tessera.tp's role -> style mapping.

With tensorwise scaling torchao's styles cast a block's input to float8 before the all-gather
(sequence parallel) so the gather moves half the bytes of bf16, and cast gradients likewise.
The rowwise recipes keep torch's plain styles, as torchtitan does: Float8Linear accepts
DTensor inputs and torchao's float8 TP styles assume one scale per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_tensor_parallel import (
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)

from tessera.float8.options import Float8Options

# tessera.tp's role names (tessera.tp.ROLES). Strings here: tessera.float8 may import
# tessera.mesh only; a test checks they stay equal.
COLWISE, ROWWISE, BLOCK_INPUT = "colwise", "rowwise", "block_input"

# tessera.tp's StyleFactory: takes its Layouts (read here: `.sequence_parallel` and
# `.between_blocks`, the hidden state's placement between blocks) and returns the role's style.
StyleFactory = Callable[[Any], ParallelStyle]


class _Float8OrPlain(ParallelStyle):
    """One role's style, chosen per module when parallelize_module applies it: the float8 style
    where every linear inside is float8, else the plain one (filters leave some linears plain,
    e.g. small wk/wv). Under sequence parallel the float8 styles all-gather float8 tensors, which
    gloo cannot carry ("Invalid scalar type"), so a CPU mesh gets the plain style there too: the
    linears still compute in float8, only activations travel in high precision."""

    def __init__(self, float8: ParallelStyle, plain: ParallelStyle, *, moves_float8: bool):
        self.float8, self.plain, self.moves_float8 = float8, plain, moves_float8

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        all_float8 = bool(linears) and all(isinstance(m, Float8Linear) for m in linears)
        gloo = self.moves_float8 and device_mesh.device_type == "cpu"
        style = self.float8 if all_float8 and not gloo else self.plain
        style.src_data_rank = self.src_data_rank  # parallelize_module set it on this wrapper
        return style._apply(module, device_mesh)


def _colwise(layouts: Any) -> ParallelStyle:
    return _Float8OrPlain(Float8ColwiseParallel(), ColwiseParallel(), moves_float8=layouts.sequence_parallel)


def _rowwise(layouts: Any) -> ParallelStyle:
    return _Float8OrPlain(
        Float8RowwiseParallel(output_layouts=layouts.between_blocks),
        RowwiseParallel(output_layouts=layouts.between_blocks),
        moves_float8=layouts.sequence_parallel,
    )


def _block_input(layouts: Any) -> ParallelStyle:
    # Same layouts as tessera.tp's block_input: the hidden state arrives `between_blocks` and
    # leaves as a Replicate DTensor, so the block's colwise linears send back one gradient.
    layout = dict(input_layouts=(layouts.between_blocks,), desired_input_layouts=(Replicate(),))
    return _Float8OrPlain(
        PrepareFloat8ModuleInput(**layout), PrepareModuleInput(**layout), moves_float8=layouts.sequence_parallel,
    )


def tp_styles(options: Float8Options) -> Mapping[str, StyleFactory]:
    """Role -> StyleFactory overrides for tessera.tp.apply_tp(styles=...); empty for rowwise recipes."""
    if options.recipe_name != "tensorwise":
        return {}
    return {COLWISE: _colwise, ROWWISE: _rowwise, BLOCK_INPUT: _block_input}
