"""The address of an array's first element, compiled: ``quant._run_group`` hands the block
kernels a table of addresses (weights, activations, outputs of every product of a step), about
1,500 of them a MoE decode token. numpy's ``__array_interface__`` builds a dict for each (~1 µs);
a compiled call returns the pointer in ~0.1 µs. Import through ``quant._kernels`` (numba's cache
directory is set there first)."""

from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def address(a):  # pragma: no cover - compiled
    """The address of ``a``'s first element (int). ``a``: any numpy array numba takes."""
    return a.ctypes.data


@njit(cache=True, nogil=True)
def fill_alike(table, kind, rows, row_bytes, T, K, tile, per, addresses, x_base, x_step, out_base, out_step):  # pragma: no cover - compiled
    """Fill a group table (int64 [n, 10], qkernels' columns) for n products of one encoding and
    shape: product i's weights at ``addresses[i]``, its activations at ``x_base + i * x_step`` and
    output at ``out_base + i * out_step``, ``per`` tiles of ``tile`` rows each."""
    for i in range(table.shape[0]):
        table[i, 0] = kind
        table[i, 1] = addresses[i]
        table[i, 2] = rows
        table[i, 3] = row_bytes
        table[i, 4] = x_base + i * x_step
        table[i, 5] = T
        table[i, 6] = K
        table[i, 7] = out_base + i * out_step
        table[i, 8] = tile
        table[i, 9] = i * per
