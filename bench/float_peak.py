"""The host's float32 multiply-add peak for the vectors Reame's attention kernels are built from:
the arithmetic bound of attention over a long context (prompt chunks at depth).

    python bench/float_peak.py [--threads 1 2] [--seconds 1]

Each thread runs CHAINS independent chains of `llvm.fma.v16f32` with operands in registers,
nothing loaded or stored: the 16-lane multiply-add key_scores and value_sums issue for every
key and dimension (one zmm FMA on AVX-512, two ymm on AVX2). Prints GFLOP/s (2 FLOPs a
multiply-add); an attention kernel's share of it is its distance to the bound.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from int8_peak import _best_rate  # noqa: E402  (bench/, the script's directory, is on sys.path)

# Independent accumulators: an FMA's latency (4-5 cycles) times the 2 FMA pipes of these cores
# needs ~10 in flight; 12 zmm accumulators and 4 operands fit AVX-512's 32 registers (on AVX2
# each is two ymm and LLVM spills some: the figure is then a little under the hardware's).
CHAINS = 12
LANES = 16
_F32 = ir.FloatType()
_VEC = ir.VectorType(_F32, LANES)


@intrinsic
def _burst(typingctx, iterations, seed):
    """`iterations` rounds of CHAINS independent FMA chains on operands built from `seed` (so LLVM
    cannot fold them); returns a sum of the accumulators' first lanes (so it cannot drop them)."""
    sig = types.float64(types.int64, types.float64)

    def codegen(context, builder, signature, args):
        b = builder
        fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v16f32")
        seed = b.fptrunc(args[1], _F32)

        def splat(value):
            undef = ir.Constant(_VEC, ir.Undefined)
            return b.shuffle_vector(b.insert_element(undef, value, ir.Constant(ir.IntType(32), 0)), undef,
                                    ir.Constant(ir.VectorType(ir.IntType(32), LANES), None))

        # Factors near 1 keep the chains finite however long the burst runs.
        mul = [splat(b.fadd(ir.Constant(_F32, 0.999 - 1e-4 * i), b.fmul(seed, ir.Constant(_F32, 1e-6))))
               for i in range(2)]
        add = [splat(b.fmul(seed, ir.Constant(_F32, 1e-3 * (i + 1)))) for i in range(2)]
        accs = [cgutils.alloca_once_value(b, splat(b.fmul(seed, ir.Constant(_F32, float(i + 1)))))
                for i in range(CHAINS)]
        # An empty asm per operand and iteration (no instruction): LLVM must assume the operands
        # change, or it may fold the chains (as bench/int8_peak.py).
        launder = ir.FunctionType(_VEC, [_VEC])
        with cgutils.for_range(b, args[0]):
            m_now = [b.asm(launder, "", "=x,0", [m], False) for m in mul]
            a_now = [b.asm(launder, "", "=x,0", [a], False) for a in add]
            for i, slot in enumerate(accs):
                b.store(b.call(fma, [b.load(slot), m_now[i % 2], a_now[(i // 2) % 2]]), slot)
        total = ir.Constant(ir.DoubleType(), 0.0)
        for slot in accs:
            total = b.fadd(total, b.fpext(b.extract_element(b.load(slot), ir.Constant(ir.IntType(32), 0)),
                                          ir.DoubleType()))
        return total

    return sig, codegen


@njit(parallel=True, cache=False)
def _run(threads, iterations):
    out = np.zeros(threads)
    for t in prange(threads):
        out[t] = _burst(iterations, float(t + 1))
    return out


def float32_peak(threads: int, seconds: float = 1.0) -> float:
    """float32 FLOP/s (GFLOP/s, 2 a multiply-add) of 16-lane FMAs on `threads` threads: the best
    of 3 bursts of ~seconds."""
    numba.set_num_threads(threads)
    rate = _best_rate(lambda n: _run(threads, n), 100_000, seconds)
    return threads * rate * CHAINS * LANES * 2 / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    for threads in args.threads:
        print(f"float32 FMA: {threads} thread(s): {float32_peak(threads, args.seconds):.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
