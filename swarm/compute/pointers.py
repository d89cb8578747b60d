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


@njit(cache=True, nogil=True)
def fill_experts(table, meta, addresses, sel):  # pragma: no cover - compiled
    """A MoE decode step's two group tables (qkernels' columns) for its n experts ``sel`` (int64
    [n]), in table int64 [3n, 10]: rows ``0 .. 2n-1`` the gate then the up products (weights at
    ``addresses[0, e]``, ``addresses[1, e]``), rows ``2n ..`` the down products
    (``addresses[2, e]``); ``addresses`` int64 [3, E]. ``meta`` int64 [2, 11], for the gate/up
    part then the down part: (kind, rows, row_bytes, T, K, tile, per, x_base, x_step, out_base,
    out_step); the i-th product of a part reads ``x_base + i * x_step``, writes ``out_base + i *
    out_step`` and starts at tile ``i * per``, as :func:`fill_alike` numbers them."""
    n = sel.shape[0]
    for r in range(3 * n):
        part = 0 if r < 2 * n else 1
        i = r - 2 * n * part
        m = meta[part]
        table[r, 0] = m[0]
        table[r, 1] = addresses[r // n, sel[r % n]]
        table[r, 2] = m[1]
        table[r, 3] = m[2]
        table[r, 4] = m[7] + i * m[8]
        table[r, 5] = m[3]
        table[r, 6] = m[4]
        table[r, 7] = m[9] + i * m[10]
        table[r, 8] = m[5]
        table[r, 9] = i * m[6]
