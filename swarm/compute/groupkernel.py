"""One compiled call that computes a group of block-kernel products, tile by tile, on however many
threads run it at once; import through ``quant._group_kernel`` (after the block kernels).

Theory of operation. A group is described by a table: one row per product ``out = x @ W.T``
(its kind, the addresses and shapes of ``W``, ``x`` and ``out``, and how many weight rows a
*tile* of it holds). The group's tiles are numbered across the products in order; each thread
that runs :func:`run_group` on the table takes the next tile number from a shared counter (an
atomic add), computes that tile with the block kernels (:func:`swarm.compute.qkernels._rows`,
one thread over a range of output rows), and takes the next, until none is left. So a thread
costs the pool one Python call per group, not one per tile, and tiles small enough to keep 16
threads evenly busy cost ~0.1 µs each to hand out. A tile's result does not depend on which
thread computed it: each output element keeps its one sequence of float32 operations.

The addresses come from arrays the caller keeps alive for the call; the caller checks every
shape (:meth:`QMatrix._operands`) before the table is written, since the compiled side trusts it.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from swarm.compute.qkernels import _rows

# Columns of a group table (int64 [n, NCOLS]).
KIND, W, W_ROWS, W_ROW_BYTES, X, T, K, OUT, TILE_ROWS, FIRST_TILE = range(10)
NCOLS = 10


def _view(dtype, readonly: bool):
    """An intrinsic: the C-order 2-D array of ``dtype`` at address ``addr`` with ``rows × cols``
    elements, owning nothing (as ``numba.carray``), read-only or not: the types the block
    kernels are compiled for, so this module links their compiled code rather than compiling it
    again."""
    aryty = types.Array(dtype, 2, "C", readonly=readonly)

    @intrinsic
    def view(typingctx, addr, rows, cols):
        sig = aryty(types.int64, types.int64, types.int64)

        def codegen(context, builder, sig, args):
            addr, rows, cols = args
            ary = context.make_array(aryty)(context, builder)
            itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(dtype)))
            data = builder.inttoptr(addr, context.get_data_type(dtype).as_pointer())
            populate_array(ary, data=data, shape=[rows, cols], strides=[builder.mul(cols, itemsize), itemsize],
                           itemsize=itemsize, meminfo=None)
            return ary._getvalue()
        return sig, codegen
    return view


_weights = _view(types.uint8, True)
_floats = _view(types.float32, False)


@intrinsic
def _take(typingctx, counter):
    """``counter[0] += 1`` atomically (int64 array); returns the value before."""
    sig = types.int64(counter)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", data, ir.Constant(ir.IntType(64), 1), "monotonic")
    return sig, codegen


@njit(cache=True, nogil=True)
def run_group(table, counter, tiles):  # pragma: no cover - compiled
    """Compute tiles of the group ``table`` (int64 [n, NCOLS]) until ``counter`` (int64 [1],
    shared by every thread running this call) passes ``tiles``, the group's tile count. Returns
    the tiles this thread computed. Releases the GIL."""
    done = 0
    i = 0
    while True:
        t = _take(counter)
        if t >= tiles:
            return done
        while i + 1 < table.shape[0] and table[i + 1, FIRST_TILE] <= t:  # a thread's t only grows
            i += 1
        rows, step = table[i, W_ROWS], table[i, TILE_ROWS]
        lo = (t - table[i, FIRST_TILE]) * step
        w = _weights(table[i, W], rows, table[i, W_ROW_BYTES])
        x = _floats(table[i, X], table[i, T], table[i, K])
        out = _floats(table[i, OUT], table[i, T], rows)
        _rows(table[i, KIND], w, x, out, lo, min(rows, lo + step))
        done += 1
