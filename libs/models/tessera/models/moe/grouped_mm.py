"""Grouped matmuls for every dtype, eager and compiled: the experts' GEMMs without a Python loop.

``torch._grouped_mm(a [rows, k], b [groups, k, n], offs)`` multiplies each group of rows (ending
at ``offs``) by its own matrix. torch 2.13 runs it for any dtype in eager mode (on CPU one matmul
per group in C++, bit for bit the per-expert loop's; on CUDA CUTLASS for bfloat16 from compute
capability 9.0, else a C++ loop that reads the offsets on the host), but its meta function, which
compile and tools/estimate's fake tensors trace, takes bfloat16 only.

``grouped_mm`` calls the aten op, with torch's autograd, on real tensors and in bfloat16 (so
inductor and torchao's low-precision wrappers see it); traced in other dtypes it goes through
the custom op ``tessera::grouped_mm``: the same kernel, with a shape function for any dtype and
its backward as two more grouped matmuls (the input's gradient by the transposed weights, each
group's weight gradient ``a_g^T grad_g``: the 2-D x 2-D form, ``[groups, k, n]``). Eager mode
keeps torch's autograd because, measured (torch 2.13, fp32), the custom op's backward under
DualPipeV's split backward gave the last stage's experts another optimizer step than one
process's (test_mtp_train); compiled pipelines with fp32 experts have no test yet. The kernel
wants 16-byte rows: features that are not (test-sized models) are zero-padded to them.

Under autocast the operands are cast to its dtype first, as autocast casts a matmul's: torch
2.13's autocast has no rule for the grouped matmul, so fp32 weights would otherwise keep the
experts in fp32 while every other matmul of the model ran in bf16.
"""

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake


@torch.library.custom_op("tessera::grouped_mm", mutates_args=())
def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm.register_fake
def _(a, b, offs):
    if b.dim() == 3:  # [rows, k] x [groups, k, n] -> [rows, n]
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])  # [k, rows] x [rows, n] -> [groups, k, n]


def _setup_context(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_a = _grouped_mm(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = _grouped_mm(a.transpose(-2, -1), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [rows, k] x b [groups, k, n] with group g's rows ending at ``offs[g]`` (int32) -> [rows, n];
    any dtype, compiled or not (module docstring)."""
    device = a.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        a, b = a.to(dtype), b.to(dtype)
    k, n = b.shape[-2:]
    align = 16 // a.element_size()
    if k % align or n % align:  # zero features add nothing
        a = F.pad(a, (0, -k % align))
        return grouped_mm(a, F.pad(b, (0, -n % align, 0, -k % align)), offs)[:, :n]
    if torch.compiler.is_compiling() or device == "meta" or is_fake(a):  # traced: shapes by its meta function
        return torch._grouped_mm(a, b, offs=offs) if a.dtype == torch.bfloat16 else _grouped_mm(a, b, offs)
    out = torch._grouped_mm(a, b, offs=offs)
    if out.requires_grad:  # its backward takes no strided gradient (a sum's expanded one)
        out.register_hook(torch.Tensor.contiguous)
    return out
