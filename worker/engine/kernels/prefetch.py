"""Software prefetch of a whole small array (a KV slab) into the caches.

The decode attention reads each (block, layer, kv head) slab of K and V — 2 KB at 16 tokens ×
64 dims of float16 — from blocks scattered over the pool, so the hardware prefetcher restarts at
every block and the first lines of each slab wait out a DRAM access. Asking for the next block's
slab while the current one is scored overlaps those waits with the arithmetic (attention.py
measures it). A prefetch never faults and never changes a value: results keep their bits.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_LINE = 64  # bytes per cache line on every x86_64 and ARM64 server CPU the engine targets


@intrinsic
def prefetch(typingctx, array):
    """Prefetch every cache line of a C-contiguous array for reading (llvm.prefetch, data, into
    all cache levels): a no-op where the target has no prefetch instruction."""
    if not isinstance(array, types.Array) or array.layout != "C":
        return None
    sig = types.void(array)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
        base = builder.bitcast(arr.data, i8p)
        item = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        nbytes = builder.mul(arr.nitems, ir.Constant(i64, item))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), nbytes, ir.Constant(i64, _LINE)) as (offset, _):
            # read (0), locality 3 (keep in every level), data cache (1)
            builder.call(fn, [builder.gep(base, [offset]), ir.Constant(i32, 0), ir.Constant(i32, 3),
                              ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen
