"""Every kernel variant, by (op, variant), with the quant types it serves; and the op table the
fused model steps dispatch through.

Tests parametrize over KERNELS so a new variant cannot land untested. The weight ops' reference
twin is plain float32 math on weights dequantized by `worker.engine.quants.dequantize`
(bit-identical to gguf.quants); attention's is float64 attention over the K/V the pool holds.

The fused steps never pick a variant themselves: the engine resolves an OpTable (one variant per
dispatched op) and passes its codes to every step, where `decode_parts` branches on them (one
branch per entry, built from this registry) and calls the function the chosen entry names. Codes are an argument, not a compile-time constant,
so the table can be swapped between two steps without recompiling anything.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from worker.engine.kernels import attention, matmul_amx, matmul_batch, matmul_i8, ops, prompt_attention
from worker.engine.kernels.packing import LAYOUT_QUADS, LAYOUT_ROWS
from worker.engine.quants import SPECS


# What each numerics' matmul variants need: the packed code layout they read (packing.LAYOUT_*;
# a table is packed in one, so an engine's numerics are fixed when it loads; the row gather reads
# either) and their scratch, the slot of RowBuffers.scratch (scratches()) they take.
NUMERICS = ("float32", "int8")
_LAYOUTS = {"float32": LAYOUT_ROWS, "int8": LAYOUT_QUADS}
_SCRATCH_MAKERS = {"float32": matmul_batch.batch_scratch, "int8": matmul_i8.batch_scratch_i8}


@dataclass(frozen=True)
class KernelVariant:
    """One variant: declared once in VARIANTS, from which its code and its branch of the fused
    steps' dispatch (decode_parts) are derived."""
    op: str  # one of DISPATCHED_OPS: "matmul": W @ x[b] for B rows; "row": one dequantized row
    # (embedding lookup); "attention": each row's query over its sequence's paged K/V
    variant: str
    fn: Callable
    description: str
    numerics: str = ""  # variants with the same numerics give the same bits: a tuner may swap them
    # freely; across numerics (float32 vs int8 activations) outputs differ slightly
    min_rows: int = 1  # below this many rows the variant runs as another one does: no bucket whose
    # calls are all smaller needs it (a tuner would only time the same code twice)
    native: bool = True  # False: this host lacks its instructions and it runs as another variant
    # does (a tuner would only time the same code twice)
    code: int = -1  # the value of the op's slot in OpTable.codes that selects it: its place among
    # its op's entries of VARIANTS, set when KERNELS is built (never written by hand)

    @property
    def scratch(self) -> int:
        """The slot of RowBuffers.scratch a matmul variant takes (its numerics' scratch)."""
        return NUMERICS.index(self.numerics)


ALL_QUANT_TYPES = tuple(SPECS)  # F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K

# Every variant, one entry each. An op's first entry is its default (OpTable.of); adding a variant
# here is all it takes for the fused steps to dispatch it and for the tests and the tuner to see it.
VARIANTS = (
    KernelVariant("matmul", "float32", matmul_batch.linear_batch,
                  "each weight block converted once and applied to up to 8 rows held in "
                  "registers; float32 activations, the same bits as the yardstick matvec "
                  "(tests/kernels/yardsticks.py)", "float32"),
    KernelVariant("matmul", "int8", matmul_i8.linear_batch_i8,
                  "activations quantized per 32 to int8, dot products on AVX-512 VNNI or "
                  "AVX2 (portable IR elsewhere); rows independent", "int8"),
    KernelVariant("matmul", "float32_serial", matmul_batch.linear_batch_serial,
                  "float32 with every tile on the calling thread: no fork/join "
                  "barrier (one-row calls, a neighbour on a core)", "float32"),
    KernelVariant("matmul", "int8_serial", matmul_i8.linear_batch_i8_serial,
                  "int8 with every tile on the calling thread", "int8"),
    KernelVariant("matmul", "int8_blocked", matmul_i8.linear_batch_i8_blocked,
                  "int8 parallel over (tile, 32-row block): a block's outputs stay in "
                  "L1 across the tile's groups and few-tile matrices split evenly "
                  "over the threads (prompt chunks); the bits of int8", "int8",
                  min_rows=matmul_i8.ROW_BLOCK + 1),
    KernelVariant("matmul", "int8_amx", matmul_amx.linear_batch_amx,
                  "int8 with the integer sums of each 16 rows x 64 outputs x group on AMX "
                  "tiles (tdpbssd), the group finish of int8; the bits of int8 (prompt "
                  "chunks on AMX hosts; int8_blocked where the host has no AMX)", "int8",
                  min_rows=matmul_i8.ROW_BLOCK + 1, native=matmul_amx.AVAILABLE),
    KernelVariant("row", "gather", ops.dequant_row, "dequantize one row (embedding lookup)", "float32"),
    # Attention: one entry serves every K/V element type (float32, float16 bits, q8_0), because
    # the pool's dtype is fixed when the engine loads and numba resolves its loads and stores at
    # typing time (kv_element, kv_q8); what differs between entries is how rows become work items.
    # Both give every row the same bits (tests/kernels/test_prompt_attention.py), so a tuner may
    # swap them freely.
    KernelVariant("attention", "tiled", prompt_attention.attention_tiled,
                  "runs of consecutive rows of one sequence (prompt chunks, verification rows) a tile of "
                  "16 rows at a time, each K/V block read once per tile; decode rows one item each",
                  "float32", min_rows=2),
    KernelVariant("attention", "per_row", attention.attention_per_row,
                  "every row its own work items (row x kv head), each streaming its whole context",
                  "float32"),
)


def _with_codes(variants) -> dict[tuple[str, str], KernelVariant]:
    """KERNELS: each variant by (op, variant), its code its place among its op's entries."""
    placed: dict[str, int] = {}
    kernels = {}
    for v in variants:
        if (v.op, v.variant) in kernels:
            raise ValueError(f"kernel variant {v.op}/{v.variant} declared twice")
        kernels[(v.op, v.variant)] = replace(v, code=placed.setdefault(v.op, 0))
        placed[v.op] += 1
    return kernels


KERNELS: dict[tuple[str, str], KernelVariant] = _with_codes(VARIANTS)


def layout_for(numerics: str) -> int:
    """The packed code layout the matmul variants of `numerics` read."""
    return _LAYOUTS[numerics]


def scratches(max_tiles: int, rows: int, k_max: int) -> tuple[np.ndarray, ...]:
    """RowBuffers.scratch: one scratch per numerics (in NUMERICS order) for matmuls of up to
    `rows` rows, `max_tiles` output tiles and `k_max` inputs."""
    return tuple(_SCRATCH_MAKERS[n](max_tiles, rows, k_max=k_max) for n in NUMERICS)


# The ops a fused step dispatches on, in the order of their slots in OpTable.codes.
DISPATCHED_OPS = ("matmul", "row", "attention")
MATMUL, ROW, ATTENTION = range(len(DISPATCHED_OPS))  # slots, read inside the numba steps

# Rows per kernel call, in buckets that each get their own variant: a one-row decode call, a small
# batch, a large batch, a prompt chunk. The bucket is read per call inside the step (not per step
# in Python) because one step calls matmuls of different sizes: a 64-row prefill chunk's layers
# are in the last bucket, its output projection (one logit row) in the first.
BUCKET_LIMITS = (1, 8, 32)  # the most rows of each bucket but the last (which has no limit)
BUCKET_NAMES = ("1", "2-8", "9-32", "33+")


def bucket_of(rows: int) -> int:
    """The bucket of a call with `rows` rows (the njit twin is decode_parts.bucket_of)."""
    for b, limit in enumerate(BUCKET_LIMITS):
        if rows <= limit:
            return b
    return len(BUCKET_LIMITS)


def serves_bucket(variant: KernelVariant, bucket: int) -> bool:
    """Whether the variant runs its own code on some call of `bucket`: it is native on this host
    and some call of the bucket has at least variant.min_rows rows."""
    return variant.native and (bucket == len(BUCKET_LIMITS) or variant.min_rows <= BUCKET_LIMITS[bucket])


def variants_of(op: str, numerics: str | None = None) -> dict[str, KernelVariant]:
    """op's variants, by name; only those of one numerics when given."""
    return {v.variant: v for (o, _), v in KERNELS.items() if o == op and numerics in (None, v.numerics)}


@dataclass(frozen=True)
class OpTable:
    """The variant each dispatched op uses in each rows bucket. `codes` is what a step reads:
    codes[MATMUL, bucket_of(rows)] is the code of the matmul variant for a call of `rows` rows;
    int64 (len(DISPATCHED_OPS), len(BUCKET_NAMES)).

    Immutable: a tuner builds the next table and the engine's reference to it is swapped between
    steps; a step passes one table's codes to the whole fused call, so all its rows see one table."""
    variants: tuple[tuple[KernelVariant, ...], ...]  # [slot][bucket]
    codes: np.ndarray

    @classmethod
    def of(cls, **chosen: str | tuple[str, ...]) -> "OpTable":
        """OpTable.of(matmul="int8"): that variant in every bucket; matmul=("int8_serial", "int8",
        "int8", "float32"): one per bucket; the first registered variant for ops not named."""
        unknown = set(chosen) - set(DISPATCHED_OPS)
        if unknown:
            raise ValueError(f"no dispatched op {sorted(unknown)[0]!r} (ops: {', '.join(DISPATCHED_OPS)})")
        picked = []
        for op in DISPATCHED_OPS:
            options = variants_of(op)
            names = chosen.get(op, next(iter(options)))
            if isinstance(names, str):
                names = (names,) * len(BUCKET_NAMES)
            if len(names) != len(BUCKET_NAMES):
                raise ValueError(f"op {op!r}: {len(names)} variants for {len(BUCKET_NAMES)} buckets")
            for name in names:
                if name not in options:
                    raise ValueError(f"op {op!r} has no variant {name!r} (variants: {', '.join(options)})")
            picked.append(tuple(options[name] for name in names))
        codes = np.array([[v.code for v in per_bucket] for per_bucket in picked], np.int64)
        return cls(tuple(picked), codes)

    def names(self, op: str) -> tuple[str, ...]:
        """The variant op runs with in each bucket."""
        return tuple(v.variant for v in self.variants[DISPATCHED_OPS.index(op)])

    def numerics(self, op: str) -> str:
        """The numerics every bucket of op shares (what the K/V bytes depend on); ValueError when
        the buckets mix them."""
        kinds = {v.numerics for v in self.variants[DISPATCHED_OPS.index(op)]}
        if len(kinds) != 1:
            raise ValueError(f"op {op!r} mixes numerics across buckets: {', '.join(sorted(kinds))}")
        return kinds.pop()

    def with_variant(self, op: str, bucket: int, variant: str) -> "OpTable":
        """A new table: this one with op's variant in `bucket` replaced."""
        names = {o: self.names(o) for o in DISPATCHED_OPS}
        names[op] = names[op][:bucket] + (variant,) + names[op][bucket + 1:]
        return OpTable.of(**names)

    def __getitem__(self, op: str) -> str:
        """The variant name op runs with when every bucket agrees (table["matmul"] == "int8"),
        else the names per bucket joined by "/"."""
        names = self.names(op)
        return names[0] if len(set(names)) == 1 else "/".join(names)
