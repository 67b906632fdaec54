"""The host's int8 multiply-add peak for the instructions Reame's int8 matmuls are built from: the
arithmetic bound prefill is measured against.

    python bench/int8_peak.py [--threads 2] [--seconds 1]

Each thread runs independent accumulator chains with operands in registers, nothing loaded or
stored, in the instruction mix the kernels' inner loop needs for 32 (AVX2) or 64 (VNNI) products:
  vnni     one vpdpbusd on zmm: 64 u8 × s8 products summed into 16 int32 lanes
  avx2     vpmaddubsw (32 products, pair sums into 16 int16 lanes) + vpaddw into the accumulator,
           as matmul_i8's AVX2 step does for every 32 products
  amx      (hosts with AMX, where prompt chunks take matmul_amx) tdpbssd on tiles of the kernels'
           shape, 16 rows × 16 outputs × 32 inputs (one weight group): 8,192 products each, 4
           independent accumulator tiles (a tile's full 64-input width does twice as many)
There is no peak for the generic IR path (no AVX2: e.g. ARM64 hosts): its instruction mix is
whatever LLVM makes of it, and the laundering below needs x86 vector registers.
The ISA is matmul_i8.ISA, the one the kernels use in this process. Prints GMAC/s and GFLOP/s (2
FLOPs a multiply-add, as the prefill column of bench/engine.py counts them); a kernel's share of
this number is its distance to the bound (loads, unpacking and the per-group float work are what
it spends the rest on).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from worker.engine.kernels import matmul_amx  # noqa: E402
from worker.engine.kernels.matmul_i8 import ISA  # noqa: E402

# Independent accumulators, each with its own operand pair (equal pairs would be computed once):
# VNNI's chain runs through vpdpbusd (latency ~4-5 cycles, 1-2 a cycle), AVX2's only through the
# vpaddw, so 8 is enough there and 16 ymm registers hold 8 accumulators and 4 + 2 operands.
CHAINS = 12 if ISA == "vnni" else 8
WEIGHTS = 4  # operand vectors: WEIGHTS × ACTS = CHAINS distinct products
ACTS = CHAINS // WEIGHTS
_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


def macs_per_iteration() -> int:
    """Multiply-adds one loop iteration of _burst does (CHAINS instructions of 64 or 32)."""
    return CHAINS * (64 if ISA == "vnni" else 32)


@intrinsic
def _burst(typingctx, iterations, seed):
    """Run `iterations` rounds of CHAINS independent multiply-add chains on operands built from
    `seed` (so LLVM cannot fold them); returns a sum of the accumulators (so it cannot drop them)."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        b = builder
        lanes, acc_ty = (64, ir.VectorType(_I32, 16)) if ISA == "vnni" else (32, ir.VectorType(_I16, 16))
        byte_ty = ir.VectorType(_I8, lanes)

        def splat(value, vtype):
            undef = ir.Constant(vtype, ir.Undefined)
            return b.shuffle_vector(b.insert_element(undef, value, ir.Constant(_I32, 0)), undef,
                                    ir.Constant(ir.VectorType(_I32, vtype.count), None))

        # Small codes (0..15 and -8..7), as real weights and activations: pair sums never saturate.
        seed8 = b.trunc(args[1], _I8)
        weights = [splat(b.and_(b.add(seed8, ir.Constant(_I8, i)), ir.Constant(_I8, 15)), byte_ty) for i in range(WEIGHTS)]
        acts = [splat(b.sub(b.and_(b.add(seed8, ir.Constant(_I8, 3 + i)), ir.Constant(_I8, 15)),
                            ir.Constant(_I8, 8)), byte_ty) for i in range(ACTS)]
        if ISA == "vnni":
            vnni = cgutils.get_or_insert_function(b.module, ir.FunctionType(acc_ty, [acc_ty] * 3),
                                                  "llvm.x86.avx512.vpdpbusd.512")
        else:
            maddubs = cgutils.get_or_insert_function(b.module, ir.FunctionType(acc_ty, [byte_ty, byte_ty]),
                                                     "llvm.x86.avx2.pmadd.ub.sw")
        accs = [cgutils.alloca_once_value(b, ir.Constant(acc_ty, None)) for _ in range(CHAINS)]
        # An empty asm per operand and iteration (no instruction): LLVM must assume the operands
        # change, or it hoists the products out of the loop and times the adds alone.
        launder = ir.FunctionType(byte_ty, [byte_ty])
        with cgutils.for_range(b, args[0]):
            w_now = [b.asm(launder, "", "=x,0", [w], False) for w in weights]
            a_now = [b.asm(launder, "", "=x,0", [a], False) for a in acts]
            for i, slot in enumerate(accs):
                w, a = w_now[i % WEIGHTS], a_now[i // WEIGHTS]
                acc = b.load(slot)
                if ISA == "vnni":
                    acc = b.call(vnni, [acc, b.bitcast(w, acc_ty), b.bitcast(a, acc_ty)])
                else:
                    acc = b.add(acc, b.call(maddubs, [w, a]))
                b.store(acc, slot)
        total = ir.Constant(_I64, 0)
        for slot in accs:
            first = b.extract_element(b.load(slot), ir.Constant(_I32, 0))
            total = b.add(total, b.sext(first, _I64))
        return total

    return sig, codegen


@njit(parallel=True, cache=False)
def _run(threads, iterations):
    out = np.zeros(threads, np.int64)
    for t in prange(threads):
        out[t] = _burst(iterations, t + 1)
    return out


def _best_rate(burst, iterations: int, seconds: float) -> float:
    """Iterations a second of burst(iterations): the burst grown 4× at a time until it takes a
    quarter of `seconds`, then sized to `seconds` and timed 3 times, the best kept."""
    burst(1000)  # compile
    while True:
        t0 = time.perf_counter()
        burst(iterations)
        took = time.perf_counter() - t0
        if took > seconds / 4:
            break
        iterations *= 4
    iterations = int(iterations * seconds / took)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        burst(iterations)
        best = min(best, time.perf_counter() - t0)
    return iterations / best


def int8_peak(threads: int, seconds: float = 1.0) -> float | None:
    """Multiply-adds a second (GMAC/s) on `threads` threads: the best of 3 bursts of ~seconds;
    None where the kernels run the generic IR path (no peak to measure, see above)."""
    if ISA == "generic":
        return None
    numba.set_num_threads(threads)
    rate = _best_rate(lambda n: _run(threads, n), 100_000, seconds)
    return threads * rate * macs_per_iteration() / 1e9


@intrinsic
def _tile_burst(typingctx, iterations, cfg):
    """`iterations` × 4 tdpbssd into 4 accumulator tiles (tmm4-7) from tmm0 × tmm1-3: nothing
    loaded or stored inside the loop (the tiles start as ldtilecfg leaves them: zero)."""
    sig = types.void(iterations, cfg)

    def codegen(context, builder, signature, args):
        b = builder
        matmul_amx._asm(b, "ldtilecfg ($0)", "r,~{memory}",
                        [matmul_amx._byte_ptr(context, b, signature.args[1], args[1], matmul_amx._c(0))],
                        [matmul_amx._I8P])
        with cgutils.for_range(b, context.cast(b, args[0], signature.args[0], types.int64)):
            for v in range(4):
                matmul_amx._asm(b, f"tdpbssd %tmm{1 + v % 3}, %tmm0, %tmm{4 + v}")
        matmul_amx._asm(b, "tilerelease")
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, cache=False)
def _run_tiles(threads, iterations, cfg):
    for _ in prange(threads):
        _tile_burst(iterations, cfg)


def amx_peak(threads: int, seconds: float = 1.0) -> float | None:
    """GMAC/s of tdpbssd on tiles of matmul_amx's shape, on `threads` threads; None without AMX."""
    if not matmul_amx.AVAILABLE:
        return None
    numba.set_num_threads(threads)
    cfg = matmul_amx.tile_config(32)
    rate = _best_rate(lambda n: _run_tiles(threads, n, cfg), 10_000, seconds)
    return threads * rate * 4 * matmul_amx.ROWS * 16 * 32 / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    for threads in args.threads:
        gmacs = int8_peak(threads, args.seconds)
        if gmacs is None:
            print("the int8 kernels run the generic IR path here: no peak to measure")
            return 1
        print(f"{ISA}: {threads} thread(s): {gmacs:.0f} GMAC/s = {2 * gmacs:.0f} GFLOP/s int8")
        tiles = amx_peak(threads, args.seconds)
        if tiles is not None:
            print(f"amx: {threads} thread(s): {tiles:.0f} GMAC/s = {2 * tiles:.0f} GFLOP/s int8 (16x16x32 tiles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
