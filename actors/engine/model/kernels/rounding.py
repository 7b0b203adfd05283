"""Rounding a float32 tile to a narrower float dtype and back, round-to-nearest-even, the same
on the GPU and under the Triton interpreter (whose bf16 cast truncates)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` as torch rounds a result of that dtype, returned
    as float32 (finite values; bf16 by its bits, other dtypes by a cast)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype).to(tl.float32)
