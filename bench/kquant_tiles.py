"""The float32 K-quant products at T = 1 and 64 on this process's threads; prints one JSON line.

    COLIBRI_SWARM_THREADS=1 taskset -c 1 python3 bench/kquant_tiles.py

Q4_K [4096, 2560] and Q6_K [2560, 4096] random blocks through ``QMatrix.matmul`` under the numerics
float32, ms, best of 5 after a first call, with the tile shapes (``qkernels._K_TILES``) and the
K-quant form (``qkernels.K_FORM``) of this tree. To compare tile shapes, run it in a copy of the
tree whose ``_K_TILES`` differs (each copy compiles its own kernels).
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf import GGMLQuantizationType as QT  # noqa: E402

from swarm.compute import numerics, quant  # noqa: E402
from swarm.compute.quant import QMatrix  # noqa: E402
from tests.compute.test_quant_kernels import encoded  # noqa: E402

numerics.set_numerics("float32")
k = quant._kernels()
res = {"tiles": k._K_TILES, "kform": k.K_FORM}
for qt, R, K in ((QT.Q4_K, 4096, 2560), (QT.Q6_K, 2560, 4096)):
    w = encoded(qt, R, K, 1).copy()
    w.flags.writeable = False
    m = QMatrix(w, qt, K)
    for T in (1, 64):
        x = np.random.default_rng(0).standard_normal((T, K), dtype=np.float32)
        m.matmul(x)
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            m.matmul(x)
            best = min(best, time.perf_counter() - t)
        res[f"{qt.name}_T{T}_ms"] = round(best * 1e3, 2)
print(json.dumps(res))
