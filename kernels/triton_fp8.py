"""Widening float8 weights in Triton kernels without conversion instructions.

A weight-streaming kernel over float8 values does a multiply-add per byte it reads, so whatever widens a
byte to float32 runs once per byte too. The conversion instructions (``cvt.rn.f16x2.e4m3x2``, then
``cvt.f32.f16``) issue at a quarter of the FP32 rate on Hopper, and at 1 byte a weight they capped the first
float8 GEMV at ~2.5 TB/s (``benchmarks/fp8_weight_bench.py``, docs/performance.md). Instead the kernels load
the weights as 32-bit words and move each byte's bits into a float32 with integer shifts and masks (full
rate): a float8 value with sign s, exponent e and mantissa m, placed so that s is float32's sign and e, m
the low bits of float32's exponent and the top of its mantissa, is the same value times 2**(bias difference)
(e4m3: 2**-120, e5m2: 2**-112), for normal and subnormal values alike, so one multiply by
``fp8_word_factor`` (folded into the scale) restores it exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Per float8 format: (the right shift taking the byte's exponent and mantissa from bits 24..30 to their
# float32 places, the factor restoring the value).
_FORMATS = {torch.float8_e4m3fn: (4, 2.0**120), torch.float8_e5m2: (3, 2.0**112)}


def fp8_word_shift(dtype: torch.dtype) -> int:
    return _FORMATS[dtype][0]


def fp8_word_factor(dtype: torch.dtype) -> float:
    return _FORMATS[dtype][1]


@triton.jit
def fp8_byte_to_f32(words, J: tl.constexpr, SHIFT: tl.constexpr):
    """Byte J (0: the lowest, the first in memory) of each 32-bit word of float8 values, as float32 times
    2**-(bias difference) (module docstring): exact, with three integer operations."""
    t = words
    if J < 3:
        t = t << (24 - 8 * J)  # the byte to bits 24..31 (int32: the shift right below may copy the sign
        # bit into bits the mask drops)
    magnitude = (t >> SHIFT) & (0x7F << (24 - SHIFT))
    return ((t & -2147483648) | magnitude).to(tl.float32, bitcast=True)
