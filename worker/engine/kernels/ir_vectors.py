"""Pieces of LLVM IR the attention micro-kernels (key_scores, value_sums) share: float vectors,
their multiply-add, a row of a KV slab loaded as float32, and a counted loop that carries vector
accumulators in registers (as phi values) from one iteration to the next."""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

I32, I64 = ir.IntType(32), ir.IntType(64)


def float_vector(width: int) -> ir.VectorType:
    return ir.VectorType(ir.FloatType(), width)


def fma_function(builder: ir.IRBuilder, vec: ir.VectorType):
    """llvm.fma for `vec`: a·b + c rounded once, lane by lane."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3),
                                          f"llvm.fma.v{vec.count}f32")


def splat(builder: ir.IRBuilder, value, vec: ir.VectorType):
    """`value` (a float) in every lane of `vec`."""
    undef = ir.Constant(vec, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(I32, vec.count), None))


def load_row(builder: ir.IRBuilder, pointer, vec: ir.VectorType, half: bool):
    """vec.count consecutive pool elements from `pointer` as float32: float16 bits are converted
    (vcvtph2ps), float32 loaded as they are."""
    if half:
        bits = builder.load(builder.bitcast(pointer, ir.VectorType(ir.IntType(16), vec.count).as_pointer()), align=2)
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), vec.count)), vec)
    return builder.load(builder.bitcast(pointer, vec.as_pointer()), align=4)


def counted_loop(builder: ir.IRBuilder, count, initial: list, name: str):
    """Open `for i in range(count)` (count >= 1: the body runs before the test) carrying `initial`.

    Returns (i, carried, close): the body reads `carried` (this iteration's values) and ends with
    close(updated), which feeds `updated` to the next iteration and leaves the builder after the
    loop, where `updated` holds the final values."""
    entry = builder.block
    body = builder.append_basic_block(f"{name}.body")
    after = builder.append_basic_block(f"{name}.after")
    builder.branch(body)
    builder.position_at_end(body)
    i = builder.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    carried = []
    for value in initial:
        phi = builder.phi(value.type)
        phi.add_incoming(value, entry)
        carried.append(phi)

    def close(updated: list) -> None:
        following = builder.add(i, ir.Constant(I64, 1))
        end = builder.block
        i.add_incoming(following, end)
        for phi, value in zip(carried, updated):
            phi.add_incoming(value, end)
        builder.cbranch(builder.icmp_signed("<", following, count), body, after)
        builder.position_at_end(after)

    return i, carried, close
