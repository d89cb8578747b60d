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
