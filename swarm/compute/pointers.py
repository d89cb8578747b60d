"""The address of an array's first element, compiled: ``quant._run_group`` hands the block
kernels a table of addresses (weights, activations, outputs of every product of a step), about
1,500 of them a MoE decode token. numpy's ``__array_interface__`` builds a dict for each (~1 µs);
a compiled call returns the pointer in ~0.1 µs. Import through ``quant._kernels`` (numba's cache
directory is set there first)."""

from __future__ import annotations

import numpy as np
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


@njit(cache=True, nogil=True)
def fill_expert_rows(table, meta, addresses, sel, x, xg, rank):  # pragma: no cover - compiled
    """A MoE step of n decode rows: its two group tables with each selected expert once, over
    the rows routed to it (as ``LocalFFN.ffn`` groups them). ``sel`` int64 [n, k]: each row's
    experts, ascending; ``x`` float32 [n, H]: the rows. Writes ``xg`` float32 [n k, H]: the rows
    grouped by expert (experts ascending, rows ascending within one), ``rank`` int64 [n, k]: the
    row of xg (and of the products' outputs) that row i's s-th expert reads and writes, and into
    ``table`` int64 [≥ 3D, 10] for the D distinct experts (qkernels' columns): rows ``0 .. 2D-1``
    the gate then the up products, rows ``2D .. 3D-1`` the down products. ``addresses`` and
    ``meta`` as :func:`fill_experts`, with x_step and out_step the bytes of an activation row and
    an output row (the up products' outputs start n k rows after the gate products'). Returns D."""
    n, k = sel.shape
    nk = n * k
    E = addresses.shape[1]
    start = np.zeros(E + 1, np.int64)
    for i in range(n):
        for s in range(k):
            start[sel[i, s] + 1] += 1
    for e in range(E):
        start[e + 1] += start[e]
    cur = start[:E].copy()
    for i in range(n):
        for s in range(k):
            e = sel[i, s]
            p = cur[e]
            cur[e] = p + 1
            rank[i, s] = p
            xg[p, :] = x[i, :]
    D = 0
    for e in range(E):
        if start[e + 1] > start[e]:
            D += 1
    j = 0
    for e in range(E):
        st, cnt = start[e], start[e + 1] - start[e]
        if cnt == 0:
            continue
        for part in range(3):  # gate, up, down
            r = j + part * D
            m = meta[0] if part < 2 else meta[1]
            table[r, 0] = m[0]
            table[r, 1] = addresses[part, e]
            table[r, 2] = m[1]
            table[r, 3] = m[2]
            table[r, 4] = m[7] + st * m[8]
            table[r, 5] = cnt
            table[r, 6] = m[4]
            table[r, 7] = m[9] + ((part == 1) * nk + st) * m[10]
            table[r, 8] = m[5]
            table[r, 9] = (r if part < 2 else j) * m[6]
        j += 1
    return D
