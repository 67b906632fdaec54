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
