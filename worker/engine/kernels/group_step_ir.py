"""What the two group-step code generators share (matmul_batch's float32 `_group_step` and
matmul_i8's int8 `_i8_step`): the switch on the row count, the prefetch of the codes ahead, array
addressing, and the multiply by a factored matrix's units (packing: step × unit).

Both steps take their operands in bundles: the table's arrays (packing.TableArrays), where the
group is (GroupAt), the activations, `out`, and the rows. A subclass sets the fields read here (b,
context; fmt, group; the arrays through `_take_arrays`, GroupAt's fields through `_take_group`;
rows) and gives `_rows(n)` and its ways of loading vector v of TILE parameters (`_halves_of`:
float16, `_floats_of`: float32, `_steps_of`: int8 steps); `_param` picks one by the group's type.
"""
from __future__ import annotations

from typing import NamedTuple

from llvmlite import ir
from numba import types
from numba.core import cgutils

from worker.engine.kernels.packing import PARAM_F16, PARAM_STEP8, code_bytes_per_group

VEC = 16  # float32 lanes of one vector
PREFETCH_GROUPS = 4  # groups ahead whose codes each step prefetches (2 to 16 measured alike)
_I64 = ir.IntType(64)
_F32S = ir.VectorType(ir.FloatType(), VEC)
_HALVES = ir.VectorType(ir.HalfType(), VEC)


class GroupAt(NamedTuple):
    """Where one group of one tile is, for a group step (each an int64)."""
    d_off: int  # byte offset of the group's codes in data
    s_off: int  # offset of its TILE scales in scales, scales16 or data (by param)
    m_off: int  # offset of its TILE biases, likewise; < 0 for none
    u_off: int  # offset of its units in scales16 when its matrix is factored (packing.unit_offset), else < 0
    param: int  # packing.PARAM_*: its parameters are float32 (scales), float16 (scales16) or int8 steps (data)
    k0: int  # its first input: the column of x (or the quantized activations) it starts at
    g: int  # its index in the row: the column of the group sums
    col0: int  # the tile's first output column in out


class GroupStepEmitter:
    step_rows: tuple[int, ...] = ()  # the row counts compiled, one straight-line case each
    name = "step"  # basic-block names in the IR

    def emit(self):
        b = self.b
        self._prefetch()
        self.is_half = b.icmp_signed("==", self.param, self._c(PARAM_F16))
        self.is_step8 = b.icmp_signed("==", self.param, self._c(PARAM_STEP8))
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

    def _floats_of(self, offset, v):
        """Vector v of the TILE float32 parameters at `offset` of scales, as <16 x float>."""
        raise NotImplementedError

    def _steps_of(self, offset, v):
        """Vector v of the TILE int8 steps at byte `offset` of data, as <16 x i8>."""
        raise NotImplementedError

    def _param(self, offset, v):
        """Vector v of the TILE group parameters (scales or biases) at offset, as float32; a
        factored matrix's are its steps, which _times_unit then multiplies by the units."""
        b = self.b
        with b.if_else(self.is_step8) as (steps, whole):
            with steps:
                from_steps = b.sitofp(self._steps_of(offset, v), _F32S)
                steps_block = b.block
            with whole:
                with b.if_else(self.is_half) as (then, otherwise):
                    with then:
                        from_half = b.fpext(self._halves_of(offset, v), _F32S)
                        half_block = b.block
                    with otherwise:
                        from_f32 = self._floats_of(offset, v)
                        f32_block = b.block
                whole_value = b.phi(_F32S)
                whole_value.add_incoming(from_half, half_block)
                whole_value.add_incoming(from_f32, f32_block)
                whole_block = b.block
        value = b.phi(_F32S)
        value.add_incoming(from_steps, steps_block)
        value.add_incoming(whole_value, whole_block)
        return value

    def _prefetch(self):
        """Ask for the codes PREFETCH_GROUPS groups ahead (the next tiles' once near a tile's end)."""
        b = self.b
        group_bytes = code_bytes_per_group(self.fmt, self.group)
        fn = cgutils.get_or_insert_function(
            b.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()] + [ir.IntType(32)] * 3),
            "llvm.prefetch.p0i8")
        start = b.add(self.d_off, self._c(PREFETCH_GROUPS * group_bytes))
        for line in range(0, group_bytes, 64):
            at = b.bitcast(self._ptr("data", b.add(start, self._c(line))), ir.IntType(8).as_pointer())
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

    def _take_arrays(self, ty, value, names):
        """Make the named members of a (named) tuple argument of arrays addressable by name
        (self.arrays, which the subclass starts empty); a bare array argument (ty an Array) under
        names[0]."""
        if isinstance(ty, types.Array):
            members = {names[0]: (ty, value)}
        else:
            members = dict(zip(ty.fields, zip(ty.types, cgutils.unpack_tuple(self.b, value))))
        for name in names:
            t, v = members[name]
            self.arrays[name] = (t, self.context.make_array(t)(self.context, self.b, v))

    def _take_group(self, ty, value):
        """GroupAt's fields as int64 attributes (d_off, s_off, ...)."""
        for name, t, v in zip(ty.fields, ty.types, cgutils.unpack_tuple(self.b, value)):
            setattr(self, name, self.context.cast(self.b, v, t, types.int64))

    def _c(self, n):
        return ir.Constant(_I64, n)

    def _ptr(self, name, *indices):
        ty, ary = self.arrays[name]
        return cgutils.get_item_pointer(self.context, self.b, ty, ary, list(indices))

    def _vptr(self, name, vtype, *indices):
        return self.b.bitcast(self._ptr(name, *indices), vtype.as_pointer())
