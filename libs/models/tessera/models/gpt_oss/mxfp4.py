"""MXFP4 (OCP Microscaling, FP4 E2M1 elements, one E8M0 scale per 32) as GPT-OSS's released
checkpoints store their experts: ``<name>_blocks`` [E, rows, cols / 32, 16] uint8, two 4-bit
elements a byte (the low nibble first), and ``<name>_scales`` [E, rows, cols / 32] uint8, the
power of two (biased by 127) each block of 32 elements is multiplied by. The rows are the
weight's output features (``nn.Linear`` layout), so the dequantised [E, rows, cols] is
transposed to the x @ W layout the model holds ([E, cols, rows]).

Every dequantised value is a 4-bit element times a power of two, exact in bfloat16 (8 exponent
bits, as float32).
"""

import torch

# FP4 E2M1: sign, 2 exponent bits, 1 mantissa bit; the code's value by its 4 bits.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [E, rows, G, 16] uint8 and scales [E, rows, G] uint8 -> [E, G * 32, rows] in
    ``dtype``, one expert at a time (the index tensors of a whole 120B layer would take tens of GB)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4: blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    values = torch.tensor(FP4_E2M1, dtype=dtype, device=blocks.device)
    n_experts, rows, groups, width = blocks.shape
    out = torch.empty(n_experts, groups * 2 * width, rows, dtype=dtype, device=blocks.device)
    for e in range(n_experts):
        codes = blocks[e].to(torch.uint8)
        elements = torch.stack([values[(codes & 0x0F).int()], values[(codes >> 4).int()]], dim=-1).flatten(-2)
        exponents = scales[e].to(torch.int32).unsqueeze(-1) - SCALE_BIAS
        out[e] = torch.ldexp(elements, exponents).to(dtype).flatten(-2).T
    return out
