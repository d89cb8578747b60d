"""The int8 tiles' forms against each other and the float32 kernel, one thread; prints JSON lines.

    python3 bench/int8_forms.py

Per weight type (Q8_0, Q4_0, Q4_1 on [1536, 576]; Q4_K, Q6_K on [1536, 1024]) and T = 1, 8:
ms (best of 5, after a first call) of the int8 rows kernel in every form that compiles on this
CPU (VNNI, AVX2, the vector form: plain vector arithmetic compiled for this CPU, the portable
form: scalar integer loops), one thread, whether their outputs have the same bits, and the
float32 kernel (QMatrix.matmul, as the engine runs it: on this process's threads) on the same
weights. The first line names the CPU and the form the process runs. The first run compiles
every form (minutes).
"""

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from swarm.compute import quant  # noqa: E402
import gguf  # noqa: E402

from swarm.compute import numerics  # noqa: E402
from swarm.compute.quant import QMatrix  # noqa: E402
from tests.compute.test_int8_numerics import KINDS  # noqa: E402
from tests.compute.test_quant_kernels import encoded  # noqa: E402
QT = gguf.GGMLQuantizationType
k = quant._kernels()
from swarm.compute import threads  # noqa: E402


def best_ms(call) -> float:
    """ms of ``call()``, best of 5."""
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return round(best * 1e3, 3)


print(json.dumps({"cpu": platform.processor() or platform.machine(), "int8_form": k.I8_FORM,
                  "threads": threads.threads()}), flush=True)
for qt, R, K in ((QT.Q8_0, 1536, 576), (QT.Q4_0, 1536, 576), (QT.Q4_1, 1536, 576), (QT.Q4_K, 1536, 1024), (QT.Q6_K, 1536, 1024)):
    kind = KINDS[qt]
    w = encoded(qt, R, K, 1).copy()
    for T in (1, 8):
        x = np.random.default_rng(0).standard_normal((T, K), dtype=np.float32)
        xq = np.zeros((T, k.int8_row_bytes(kind, K)), np.uint8); k.quantize(kind, x, xq)
        res = {"type": qt.name, "R": R, "K": K, "T": T}
        outs = {}
        for form in k.I8_FORMS_HERE:
            f = k._I8_ROWS[kind] if form == k.I8_FORM else k._i8_rows_kernel(kind, form)
            out = np.zeros((T, R), np.float32); f(w, xq, out, 0, R)
            res[f"{form}_ms"] = best_ms(lambda: f(w, xq, out, 0, R)); outs[form] = out.copy()
        numerics.set_numerics("float32")
        m = QMatrix(w, qt, K)
        m.matmul(x)
        res["float32_ms"] = best_ms(lambda: m.matmul(x))
        res["same_bits"] = all(np.array_equal(o.view(np.uint32), outs["portable"].view(np.uint32)) for o in outs.values())
        res["portable_over_vector"] = round(res["portable_ms"] / res["vector_ms"], 1)
        res[f"float32_over_{k.I8_FORM}"] = round(res["float32_ms"] / res[f"{k.I8_FORM}_ms"], 2)
        print(json.dumps(res), flush=True)
