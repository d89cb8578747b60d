"""The activation numerics of this process: how a matrix product treats its activation rows.

* ``float32`` (the default): activations stay float32, each weight is decoded to float32 and
  applied by fused multiply-add (swarm/compute/quant.py). Checked against the transformers
  oracle (max logit difference ≲ 1e-4 on SmolLM2), and a swarm's results are the bits of a
  local run.
* ``int8``: llama.cpp's numerics. Each activation row is quantized to 8 bits (a float32 scale
  per 256 values for Q4_K, Q5_K and Q6_K weights, per 32 for Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1:
  ggml's Q8_K, Q8_0 and Q8_1 blocks) and
  multiplied by the weights' integers exactly, then scaled in float32 (swarm/compute/qkernels.py,
  the int8 section). Faster on quantized weights; each product carries the quantization's error,
  about 1e-2 of its largest output. Weight types without an int8 kernel (F32/F16/BF16, MXFP4,
  the low-bit types Q2_K, Q3_K and IQ*) keep float32. Decode and prefill take the same kernels:
  a token's numbers do not depend on T, the row ranges or the thread count.

A swarm computes with its coordinator's numerics. The coordinator checks a peer's answers bit
for bit against its own recomputation, or — for another build, a GPU or a page — within a bound
of float reassociation (swarm/peer/coordinator/bounds.py); 8-bit activations' rounding lies
outside that bound, so a coordinator gives work only to peers of its own numerics, and under
int8 only to peers of its own build, whose answers it recomputes to the bit (a peer announces
its numerics in its build: swarm/peer/node.py numeric_build).
The choice: ``generate``'s and ``join``'s ``--numerics``, ``$COLIBRI_SWARM_NUMERICS``,
:func:`set_numerics`.
"""

from __future__ import annotations

import os

NUMERICS_ENV = "COLIBRI_SWARM_NUMERICS"
CHOICES = ("float32", "int8")

_numerics: str | None = None


def numerics() -> str:
    """This process's numerics: the last :func:`set_numerics`, else ``$COLIBRI_SWARM_NUMERICS``,
    else ``float32``. Raises ValueError for an environment value not in :data:`CHOICES`."""
    global _numerics
    if _numerics is None:
        _numerics = check(os.environ.get(NUMERICS_ENV, "") or "float32", NUMERICS_ENV)
    return _numerics


def int8() -> bool:
    """Whether products with an int8 kernel quantize their activation rows."""
    return (_numerics or numerics()) == "int8"


def set_numerics(name: str | None) -> str:
    """Use the numerics ``name`` from now on (None: the environment's, else float32); returns it.
    Raises ValueError for a name not in :data:`CHOICES`."""
    global _numerics
    _numerics = None if name is None else check(name, "the numerics")
    return numerics()


def check(name: str, what: str) -> str:
    """``name`` when it is one of :data:`CHOICES`; else ValueError naming ``what`` and the choices."""
    if name not in CHOICES:
        raise ValueError(f"{what} must be one of {', '.join(CHOICES)}, got {name!r}")
    return name
