"""Rounding a float32 tile to a narrower float dtype and back, round-to-nearest-even, the same
on the GPU and under the Triton interpreter (whose bf16 and fp8 casts do not round to nearest
even: there the rounding is done by bits)."""

from __future__ import annotations

import triton
import triton.language as tl

from actors.engine.model.kernels import interpreted

#: whether kernels are compiled for the GPU, whose casts round to nearest even (one ``cvt`` an
#: element, where the rounding by bits takes several integer operations)
NATIVE_CASTS = tl.constexpr(not interpreted())


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` as torch rounds a result of that dtype, returned
    as float32 (finite values; bf16 by its bits under the interpreter, other dtypes and the GPU
    by a cast)."""
    if dtype == tl.float32:
        return x
    elif dtype == tl.bfloat16 and not NATIVE_CASTS:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)
