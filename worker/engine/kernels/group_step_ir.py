"""What the two group-step code generators share (matmul_batch's float32 `_group_step` and
matmul_i8's int8 `_i8_step`): the switch on the row count, the prefetch of the codes ahead, array
addressing, and the multiply by a factored matrix's units (packing: step × unit).

A subclass names its arguments' positions (DATA, SCALES16), sets the fields read here (b, context,
tys, arrays; fmt, group; d_off, m_off, u_off, half, rows) and gives `_rows(n)` and
`_halves_of(offset, v)`, its way of loading vector v of TILE float16 parameters.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from worker.engine.kernels.packing import FMT_Q4, TILE

VEC = 16  # float32 lanes of one vector
PREFETCH_GROUPS = 4  # groups ahead whose codes each step prefetches (2 to 16 measured alike)
_I64 = ir.IntType(64)
_F32S = ir.VectorType(ir.FloatType(), VEC)
_HALVES = ir.VectorType(ir.HalfType(), VEC)


class GroupStepEmitter:
    DATA = SCALES16 = -1  # argument positions, set by each subclass
    step_rows: tuple[int, ...] = ()  # the row counts compiled, one straight-line case each
    name = "step"  # basic-block names in the IR

    def emit(self):
        b = self.b
        self._prefetch()
        self.is_half = b.icmp_signed("!=", self.half, ir.Constant(self.half.type, 0))
        self.has_bias = b.icmp_signed(">=", self.m_off, self._c(0))
        self.is_factored = b.icmp_signed(">=", self.u_off, self._c(0))
        done = b.append_basic_block(f"{self.name}.done")
        switch = b.switch(self.rows, done)
        for n in self.step_rows:
            case = b.append_basic_block(f"{self.name}.rows{n}")
            switch.add_case(ir.Constant(self.rows.type, n), case)
            b.position_at_end(case)
            self._rows(n)
            b.branch(done)
        b.position_at_end(done)

    def _rows(self, n):
        raise NotImplementedError

    def _halves_of(self, offset, v):
        """Vector v of the TILE float16 parameters at `offset` of scales16, as <16 x half>."""
        raise NotImplementedError

    def _prefetch(self):
        """Ask for the codes PREFETCH_GROUPS groups ahead (the next tiles' once near a tile's end)."""
        b = self.b
        group_bytes = (self.group // 2 if self.fmt == FMT_Q4 else self.group) * TILE
        fn = cgutils.get_or_insert_function(
            b.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()] + [ir.IntType(32)] * 3),
            "llvm.prefetch.p0i8")
        start = b.add(self.d_off, self._c(PREFETCH_GROUPS * group_bytes))
        for line in range(0, group_bytes, 64):
            at = b.bitcast(self._ptr(self.DATA, b.add(start, self._c(line))), ir.IntType(8).as_pointer())
            b.call(fn, [at, ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 3),
                        ir.Constant(ir.IntType(32), 1)])

    def _times_unit(self, value, v, shift):
        """value × vector v of the units at u_off + shift (0: the scale's, TILE: the bias's) when
        the parameters are factored, else value: an exact product of two float16 numbers."""
        b = self.b
        entry = b.block
        with b.if_then(self.is_factored):
            units = self._halves_of(b.add(self.u_off, self._c(shift)), v)
            scaled = b.fmul(value, b.fpext(units, _F32S))
            scaled_block = b.block
        phi = b.phi(_F32S)
        phi.add_incoming(value, entry)
        phi.add_incoming(scaled, scaled_block)
        return phi

    def _c(self, n):
        return ir.Constant(_I64, n)

    def _ptr(self, arg, *indices):
        return cgutils.get_item_pointer(self.context, self.b, self.tys[arg], self.arrays[arg], list(indices))

    def _vptr(self, arg, vtype, *indices):
        return self.b.bitcast(self._ptr(arg, *indices), vtype.as_pointer())
