"""float16 → float32 inside numba kernels.

numba has no float16 scalar type; this intrinsic reinterprets the 16 bits as an LLVM half and
extends it, which LLVM turns into vcvtph2ps (F16C) and vectorizes like any other conversion.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def f16_to_f32(typingctx, bits):
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def f32_to_f16(typingctx, x):
    """float32 → IEEE float16 bits (uint16), rounded to nearest even like numpy's astype.

    LLVM's fptrunc to half is correctly rounded (it lowers to vcvtps2ph with F16C, which
    vectorizes); overflow gives ±inf, NaN stays NaN (payload bits unspecified), float32
    values below the half subnormal range give ±0. Only float32 is accepted: convert wider
    values with np.float32 first so there is a single rounding.
    """
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen
