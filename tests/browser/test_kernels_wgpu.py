"""The WGSL kernels run natively through wgpu-py on Mesa lavapipe, against their numpy twins.

Oracles: the float32 twin in web_peer.kernels (same formats, same math), float64 numpy, and for
the GGUF block formats gguf-py's dequantization (`gguf.quants`) of the same blocks.
Relative error = max |got - ref| / max |ref|.
"""

from __future__ import annotations

import numpy as np
import pytest

from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from swarm.errors import KernelError
from tests.browser.conftest import ffn_block, rel_error
from tests.conftest import require
from web_peer import kernels as K

pytestmark = pytest.mark.browser

SHAPES = [(1, 64, 128), (5, 70, 33), (13, 576, 1536)]  # (T rows, H hidden, F intermediate)


def _gpu(**kw):
    try:
        from web_peer.wgpu_host import WgpuFfn
    except ImportError as e:
        require(False, f"wgpu-py (pip install -e '.[test]'): {e}")
    try:
        return WgpuFfn(**kw)
    except KernelError as e:
        if "no WebGPU adapter" not in str(e):
            raise
        require(False, f"a Vulkan adapter for wgpu (apt install mesa-vulkan-drivers libvulkan1): {e}")


@pytest.fixture(scope="module")
def gpu():
    with _gpu() as g:
        g._device()  # now: its poll thread belongs to the module, not to the first test
        yield g


@pytest.fixture
def new_gpu():
    """A fresh host per call (its own options), closed after the test."""
    made = []
    yield lambda **kw: made.append(_gpu(**kw)) or made[-1]
    for g in made:
        g.close()


@pytest.fixture(scope="module")
def capped_gpu():
    """A host per binding cap, shared by the tests of the module that ask for that cap (their
    buffers go with them; its device and compiled pipelines stay), closed with the module."""
    made: dict[int, object] = {}

    def get(max_binding: int):
        if max_binding not in made:
            made[max_binding] = _gpu(max_binding=max_binding)
        return made[max_binding]

    yield get
    for g in made.values():
        g.close()


def test_f16_weights_need_no_adapter_feature_and_keep_subnormals(gpu):
    # Every format on every adapter: f16 weights are read as u32 words and decoded by f16_pair,
    # so the device asks for no shader-f16 (many phone GPUs lack it) and a subnormal weight
    # (|w| < 2⁻¹⁴, here nearly half of them) is multiplied as it is, not flushed.
    assert gpu.formats == ("f32", "f16", "q8", "q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs")
    assert "shader-f16" not in gpu._device().features
    assert "enable f16" not in K.wgsl_source("down", "f16")
    rng = np.random.default_rng(67)
    w = (rng.standard_normal((40, 96)) * 1e-4).astype(np.float32)
    eff = K.as_format(w, "f16")
    assert 0.15 < (np.abs(eff) < np.finfo(np.float16).tiny).mean() < 0.9 and (eff != 0).mean() > 0.95
    x = rng.standard_normal((3, 96)).astype(np.float32)
    (y,) = gpu.matmul_many([(gpu.upload_linear(w, "f16"), x)])
    assert rel_error(y, x.astype(np.float64) @ eff.astype(np.float64).T) <= 1e-5


@pytest.mark.parametrize("fmt", ["f32", "f16", "q8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_ffn_matches_twin(gpu, fmt, shape):
    rng = np.random.default_rng(hash((fmt, shape)) % 2**32)
    x, wg, wu, wd = ffn_block(rng, *shape)
    y = gpu.ffn(x, gpu.upload(wg, wu, wd, fmt))
    assert y.shape == (shape[0], shape[1]) and y.dtype == np.float32
    eff = [K.as_format(w, fmt) for w in (wg, wu, wd)]  # what the kernel multiplies by
    assert rel_error(y, K.swiglu_ffn(x, *eff)) <= 1e-5
    assert rel_error(y, K.swiglu_ffn_f64(x, *eff)) <= 1e-5
    # Against the original float32 weights: exact for f32, the format's rounding otherwise.
    assert rel_error(y, K.swiglu_ffn_f64(x, wg, wu, wd)) <= {"f32": 1e-5, "f16": 2e-3, "q8": 3e-2}[fmt]


def test_dense_ranges_sum_to_full_mlp(gpu):
    # A dense MLP cut into intermediate ranges: partials summed in range order = the full MLP.
    rng = np.random.default_rng(7)
    x, wg, wu, wd = ffn_block(rng, 3, 96, 250)
    cuts = [0, 37, 128, 250]  # uneven, not multiples of 4: the host pads each range
    total = np.zeros((3, 96), np.float32)
    for a, b in zip(cuts, cuts[1:]):
        part = gpu.ffn(x, gpu.upload(wg[a:b], wu[a:b], np.ascontiguousarray(wd[:, a:b]), "f32"))
        assert rel_error(part, K.dense_range(x, wg[a:b], wu[a:b], np.ascontiguousarray(wd[:, a:b]))) <= 1e-5
        total += part
    assert rel_error(total, K.swiglu_ffn_f64(x, wg, wu, wd)) <= 1e-5


@pytest.mark.parametrize("fmt", ["f32", "q8"])
def test_phone_limits_split_bindings(new_gpu, fmt):
    # A binding cap far below the adapter's forces weights and activations into many parts;
    # no buffer bound may exceed it, and the numbers must not change.
    cap = 16 << 10
    gpu = new_gpu(max_binding=cap, workgroup_size=32)
    rng = np.random.default_rng(3)
    x, wg, wu, wd = ffn_block(rng, 11, 576, 700)
    w = gpu.upload(wg, wu, wd, fmt)
    assert len(w.gate.packed.parts) > 4 and len(w.down.packed.parts) > 1
    y = gpu.ffn(x, w)
    assert gpu.largest_binding <= cap
    eff = [K.as_format(m, fmt) for m in (wg, wu, wd)]
    assert rel_error(y, K.swiglu_ffn_f64(x, *eff)) <= 1e-5


def test_workgroup_size_override_within_limits(new_gpu):
    with pytest.raises(KernelError, match="power of two"):
        new_gpu(workgroup_size=4096)
    gpu = new_gpu(workgroup_size=256)
    rng = np.random.default_rng(4)
    x, wg, wu, wd = ffn_block(rng, 9, 128, 64)
    assert rel_error(gpu.ffn(x, gpu.upload(wg, wu, wd, "f32")), K.swiglu_ffn_f64(x, wg, wu, wd)) <= 1e-5


def test_row_larger_than_binding_is_refused(new_gpu):
    gpu = new_gpu(max_binding=1024)
    w = np.zeros((4, 512), np.float32)  # one f32 row = 2048 bytes > 1024
    with pytest.raises(KernelError, match="maxStorageBufferBindingSize"):
        gpu.upload(w, w, np.zeros((512, 4), np.float32), "f32")


def test_bad_inputs_are_refused(gpu):
    rng = np.random.default_rng(5)
    x, wg, wu, wd = ffn_block(rng, 2, 32, 16)
    w = gpu.upload(wg, wu, wd, "f32")
    with pytest.raises(KernelError, match="columns"):
        gpu.ffn(x[:, :31].copy(), w)
    with pytest.raises(KernelError, match="float32"):
        gpu.ffn(x.astype(np.float64), w)
    x[1, 3] = np.nan
    with pytest.raises(KernelError, match="NaN"):
        gpu.ffn(x, w)
    with pytest.raises(KernelError, match="disagree"):
        gpu.upload(wg, wu, wd.T.copy(), "f32")
    with pytest.raises(KernelError, match="format"):
        gpu.upload(wg, wu, wd, "q4")


def test_lost_device_fails_the_request_then_recovers(new_gpu):
    gpu = new_gpu()
    rng = np.random.default_rng(6)
    x, wg, wu, wd = ffn_block(rng, 4, 64, 48)
    w = gpu.upload(wg, wu, wd, "f32")
    gpu.device.destroy()  # the GPU goes away under a live request
    with pytest.raises(KernelError):
        gpu.ffn(x, w)
    with pytest.raises(KernelError, match="upload them again"):
        gpu.ffn(x, w)  # stale weights are never used on the fresh device
    w = gpu.upload(wg, wu, wd, "f32")
    assert rel_error(gpu.ffn(x, w), K.swiglu_ffn_f64(x, wg, wu, wd)) <= 1e-5


def test_q8_packing_round_trip():
    rng = np.random.default_rng(8)
    w = rng.standard_normal((5, 10)).astype(np.float32)
    w[2] = 0  # an all-zero row gets scale 1, not a division by zero
    m = K.pack_matrix(w, "q8", 1 << 20, rows=8)
    assert (m.rows, m.cols, len(m.data)) == (8, 12, 96)
    back = K.unpack_matrix(m)
    assert np.array_equal(back[5:], np.zeros((3, 12), np.float32)) and np.all(back[:, 10:] == 0)
    assert np.abs(back[:5, :10] - w).max() <= np.abs(w).max(axis=1).max() / 127 / 2 + 1e-7


# ---- GGUF block formats ----------------------------------------------------------------------

BLOCK_SHAPES = [(1, 64, 128), (37, 96, 64), (3, 576, 1536)]  # H, F multiples of 32; T = 1 and 37
K_SHAPES = [(1, 256, 256), (37, 256, 512), (3, 768, 1536)]  # H, F multiples of 256
BLOCKS_32 = tuple(f for f in K.BLOCK_FORMATS if f not in K.K_FORMATS)


def _gguf_f64(raw: np.ndarray, fmt: str) -> np.ndarray:
    # Blocks are dequantized independently: all of them as one row (gguf-py takes rows 16 at a
    # time, a call per 16 one-block rows otherwise), the same values, reshaped back.
    return dequantize(raw.reshape(1, -1), GGMLQuantizationType[fmt.upper()]).reshape(len(raw), -1).astype(np.float64)


@pytest.mark.parametrize("fmt", BLOCKS_32)
def test_block_twin_dequantizes_as_gguf(fmt):
    # The repacked planes hold the file's bytes: the twin's weights equal gguf's bit for bit,
    # padding rows are zero, and the planes together are the file's size (+2 bytes for an odd block count).
    rng = np.random.default_rng(20)
    w = rng.standard_normal((7, 96)).astype(np.float32)
    w[3] = 0  # d = 0 blocks
    raw = K.quantize_blocks(w, fmt)
    m = K.pack_matrix(raw, fmt, 1 << 20, rows=8)
    back = K.unpack_matrix(m)
    assert back.dtype == np.float32 and back.shape == (8, 96)
    assert np.array_equal(back[:7], dequantize(raw, GGMLQuantizationType[fmt.upper()]))
    assert not back[7].any()
    assert m.nbytes == 8 / 7 * raw.nbytes
    assert K.matrix_shape(raw, "w", fmt) == (7, 96)


def test_block_twin_on_the_files_own_q4_1_rows():
    # Real blocks: SmolLM2's layer-0 gate rows straight from the GGUF file.
    from tests.browser.test_page_e2e import smollm2_path
    from swarm.peer.weights.slices import ModelSlicer, SliceSpan

    blob, meta = ModelSlicer(smollm2_path()).extract(SliceSpan(0, "dense", 0, 64))
    gate = meta["tensors"][0]
    assert gate["encoding"] == "Q4_1" and gate["shape"] == [64, 576]
    raw = np.frombuffer(blob, np.uint8, gate["nbytes"], gate["offset"]).reshape(64, -1)
    m = K.pack_matrix(raw, "q4_1", 1 << 20)
    assert m.nbytes == raw.nbytes
    assert np.array_equal(K.unpack_matrix(m), dequantize(raw, GGMLQuantizationType.Q4_1))


@pytest.mark.parametrize("fmt", K.K_FORMATS)
def test_k_twin_dequantizes_as_gguf(fmt):
    # Random blocks, every bit random but the f16 d/dmin fields (finite): the twin's decoding of
    # the planes equals gguf-py's dequantize bit for bit, padding rows are zero, and the planes
    # together are the file's bytes (+2 for q6_k's d plane at an odd block count).
    rng = np.random.default_rng(24)
    raw = K.random_blocks(rng, 7, 3 * K.QK_K, fmt)
    raw[3, : raw.shape[1] // 3] = 0  # a zero block: d = dmin = 0
    m = K.pack_matrix(raw, fmt, 1 << 20, rows=8)
    back = K.unpack_matrix(m)
    assert back.dtype == np.float32 and back.shape == (8, 3 * K.QK_K)
    assert np.array_equal(back[:7], dequantize(raw, GGMLQuantizationType[fmt.upper()]))
    assert not back[7].any()
    assert m.nbytes == 8 / 7 * raw.nbytes
    assert K.matrix_shape(raw, "w", fmt) == (7, 3 * K.QK_K)
    with pytest.raises(KernelError, match="cannot quantize"):
        K.quantize_blocks(np.zeros((1, 256), np.float32), fmt)


@pytest.mark.parametrize("fmt,shape", [(f, s) for f in BLOCKS_32 for s in BLOCK_SHAPES]
                         + [(f, s) for f in K.K_FORMATS for s in K_SHAPES])
def test_block_ffn_matches_twin_and_gguf(gpu, fmt, shape):
    rng = np.random.default_rng(hash((fmt, shape)) % 2**32)
    x, wg, wu, wd = ffn_block(rng, *shape)
    raws = _raws(rng, fmt, wg, wu, wd)
    w = gpu.upload(*raws, fmt)
    assert w.nbytes <= 1.1 * sum(r.nbytes for r in raws)
    y = gpu.ffn(x, w)
    assert y.shape == (shape[0], shape[1]) and y.dtype == np.float32
    twin = [K.unpack_matrix(K.pack_matrix(r, fmt, 1 << 30)) for r in raws]
    assert rel_error(y, K.swiglu_ffn(x, *twin)) <= 1e-5
    assert rel_error(y, K.swiglu_ffn_f64(x, *(_gguf_f64(r, fmt) for r in raws))) <= 1e-5


def _raws(rng, fmt, wg, wu, wd):
    """The file's blocks of each matrix: gguf's quantizer, or random K-quant blocks of the same shape."""
    if fmt in K.K_FORMATS:
        return [K.random_blocks(rng, *w.shape, fmt, 2e-4) for w in (wg, wu, wd)]
    return [K.quantize_blocks(w, fmt) for w in (wg, wu, wd)]


def _columns(raw: np.ndarray, fmt: str, c0: int, c1: int) -> np.ndarray:
    """Columns [c0, c1) of a matrix given as float32 or the file's blocks, dequantized by gguf-py."""
    if fmt == "f32":
        return raw[:, c0:c1]
    weights, size = K.block_size(fmt)
    return _gguf_f64(np.ascontiguousarray(raw[:, c0 // weights * size : c1 // weights * size]), fmt).astype(np.float32)


@pytest.mark.parametrize("fmt", K.BLOCK_FORMATS)
@pytest.mark.parametrize("rows", [65535, 65536, 151936])
def test_rows_beyond_one_dispatch_dimension(capped_gpu, fmt, rows):
    # F = 65535 (padded to 65536), 65536 and 151936 (a Qwen vocabulary) weight rows of one block
    # each, bindings capped at 65536 rows: the grid folds rows past 65535 workgroups into y, and
    # 151936 rows go as three parts. Down takes the F columns as blocks where they are whole
    # blocks, else Q8_0 (whole 32-column blocks) or float32, as slices.py ships them.
    weights, _ = K.block_size(fmt)
    h = weights
    down_fmt = next(f for f in (fmt, "q8_0", "f32") if f == "f32" or rows % K.block_size(f)[0] == 0)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((2, h)).astype(np.float32)
    rg, ru = (K.random_blocks(rng, rows, h, fmt, 2e-4) if fmt in K.K_FORMATS
              else K.quantize_blocks(rng.standard_normal((rows, h)).astype(np.float32) * 0.2, fmt) for _ in "gu")
    wd = (rng.standard_normal((h, rows)) * 0.01).astype(np.float32)
    rd = wd if down_fmt == "f32" else (K.random_blocks(rng, h, rows, down_fmt, 1e-3) if down_fmt in K.K_FORMATS
                                       else K.quantize_blocks(wd, down_fmt))
    cap = 65536 * K.pack_matrix(rg[:1], fmt, 1 << 30).row_bytes
    gpu = capped_gpu(cap)  # one host for the three row counts of fmt
    w = gpu.upload(rg, ru, rd, fmt, down_fmt=down_fmt)
    want_parts = {65535: [65536], 65536: [65536], 151936: [65536, 65536, 20864]}[rows]
    assert [b - a for a, b in w.gate.packed.parts] == want_parts
    assert K.dispatch_grid(65536, 2) == (65535, 2, 1)
    y = gpu.ffn(x, w)
    ref = np.zeros((2, h), np.float64)
    for c0 in range(0, rows, 8192):  # the reference in column chunks (float32 weights of 151936 rows are 155 MB)
        c1 = min(c0 + 8192, rows)
        g, u = (_gguf_f64(np.ascontiguousarray(r[c0:c1]), fmt) for r in (rg, ru))
        ref += K.swiglu_ffn_f64(x, g, u, _columns(rd, down_fmt, c0, c1))
    assert rel_error(y, ref) <= 1e-5


# (workgroup size, lanes, subgroups): one row a workgroup as on CPU adapters; ROWS = 4 rows of 16
# lanes reduced in workgroup memory, as GPUs without subgroups; 8 rows of 4 lanes (and 8 of 8)
# through subgroup shuffles (lavapipe's subgroups hold 8 lanes).
ROW_SPLITS = [(8, 8, False), (64, 16, False), (32, 4, True), (64, 8, True)]


@pytest.mark.parametrize("fmt", K.BLOCK_FORMATS)
@pytest.mark.parametrize("split", ROW_SPLITS, ids=lambda s: f"wg{s[0]}-lanes{s[1]}-{'subgroup' if s[2] else 'shared'}")
def test_block_rows_split_across_a_workgroup(new_gpu, fmt, split):
    # 37 weight rows (not a multiple of ROWS: the last workgroup's extra slices write nothing),
    # T = 1 (decode), 5 and 9 (past TB: two blocks of rows along z), against the twin's weights.
    wg_size, lanes, subgroups = split
    gpu = new_gpu(workgroup_size=wg_size, lanes=lanes, subgroups=subgroups)
    assert (gpu.lanes, gpu.subgroups) == (lanes, subgroups)
    rng = np.random.default_rng(23)
    cols = 2 * K.block_size(fmt)[0]
    raw = K.random_blocks(rng, 37, cols, fmt, 2e-3)
    m = gpu.upload_linear(raw, fmt)
    xs = [rng.standard_normal((t, cols)).astype(np.float32) for t in (1, 5, 9)]
    ys = gpu.matmul_many([(m, x) for x in xs])
    w64 = _gguf_f64(raw, fmt)
    for x, y in zip(xs, ys):
        assert y.shape == (len(x), 37)
        assert rel_error(y, x.astype(np.float64) @ w64.T) <= 1e-5


# the f16 fields of each block format's blocks (byte offsets): d, and q4_1's m, the K-quants' dmin
F16_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
              "iq4_xs": (0,)}


@pytest.mark.parametrize("flushing", [False, True], ids=["adapter", "flushing-unpack"])
def test_f16_pair_decodes_every_f16_exactly(gpu, flushing):
    # rows.wgsl's f16_pair, which every block kernel reads its scales through, on all 65536 f16
    # bit patterns in each half of a word: float32 bits equal numpy's conversion (NaN as NaN),
    # subnormals included. lavapipe's unpack2x16float is itself exact, so a second run puts a
    # stand-in for it that flushes subnormals to 0 (as WGSL allows a GPU to): f16_pair must not
    # need the adapter's conversion for them.
    import wgpu
    from importlib import resources

    rows = (resources.files(K.__package__) / "rows.wgsl").read_text()
    if flushing:
        assert rows.count("unpack2x16float(w)") == 1
        rows = rows.replace("unpack2x16float(w)", "flushing_unpack(w)") + """
fn flushing_unpack(w: u32) -> vec2<f32> {
    let halves = vec2<u32>(w & 0xFFFFu, w >> 16u);
    return select(unpack2x16float(w), vec2<f32>(0.0), (halves & vec2<u32>(0x7C00u)) == vec2<u32>(0u));
}
"""
    code = rows + """
@group(0) @binding(0) var<storage, read> words: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<vec2<f32>>;
@compute @workgroup_size(64)
fn probe(@builtin(global_invocation_id) g: vec3<u32>) {
    out[g.x] = f16_pair(words[g.x]);
}
"""
    dev = gpu._device()
    low = np.arange(65536, dtype=np.uint32)
    words = low | (low[::-1] << 16)
    src = dev.create_buffer_with_data(data=words.tobytes(), usage=wgpu.BufferUsage.STORAGE)
    dst = dev.create_buffer(size=8 * words.size, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    pipe = dev.create_compute_pipeline(layout="auto", compute={"module": dev.create_shader_module(code=code),
                                                                "entry_point": "probe"})
    bind = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": src}}, {"binding": 1, "resource": {"buffer": dst}}])
    enc = dev.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pipe)
    cp.set_bind_group(0, bind)
    cp.dispatch_workgroups(words.size // 64)
    cp.end()
    dev.queue.submit([enc.finish()])
    got = np.frombuffer(dev.queue.read_buffer(dst), np.float32).reshape(-1, 2)
    want = np.stack([h.astype(np.uint16).view(np.float16).astype(np.float32) for h in (low, low[::-1])], 1)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert (got[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all()
    assert (np.abs(want) < np.finfo(np.float16).tiny).sum() == 2 * 2048  # the subnormals and ±0 were there


def test_every_f16_scale_is_read_through_f16_pair():
    # unpack2x16float only inside f16_pair: a kernel that decodes an f16 scale on its own may see
    # a subnormal d as 0 on a GPU that flushes (most Q6_K blocks of a real file).
    from importlib import resources

    users = {f.name for f in resources.files(K.__package__).iterdir()
             if f.name.endswith(".wgsl") and "unpack2x16float" in f.read_text()}
    assert users == {"rows.wgsl"}
    rows = (resources.files(K.__package__) / "rows.wgsl").read_text()
    body = rows[rows.index("fn f16_pair"):]
    assert rows.count("unpack2x16float(") == body[:body.index("\n}\n")].count("unpack2x16float(") == 1


@pytest.mark.parametrize("fmt", K.BLOCK_FORMATS)
def test_block_kernels_take_subnormal_f16_scales(gpu, fmt):
    # Every f16 field of every block (d; q4_1's m; the K-quants' dmin) an f16 subnormal of either
    # sign: the GPU's products equal gguf-py's dequantization as with normal scales.
    rng = np.random.default_rng(61)
    cols = 2 * K.block_size(fmt)[0]
    raw = K.random_blocks(rng, 19, cols, fmt, 2e-3)
    blocks = raw.reshape(19, 2, -1)
    for at in F16_FIELDS[fmt]:
        sub = rng.uniform(1e-6, 6e-5, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2])
        blocks[..., at:at + 2] = sub.astype("<f2")[..., None].view(np.uint8)
        assert (np.abs(blocks[..., at:at + 2].copy().view("<f2")) < np.finfo(np.float16).tiny).all()
    m = gpu.upload_linear(raw, fmt)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    (y,) = gpu.matmul_many([(m, x)])
    ref = x.astype(np.float64) @ _gguf_f64(raw, fmt).T
    assert np.abs(ref).max() > 1e-4
    assert rel_error(y, ref) <= 1e-5


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k", "q6_k"])
def test_subgroup_and_shared_row_sums_agree_bit_for_bit(new_gpu, fmt):
    # slice_sum's butterfly hands lane 0 the partials in the shared tree's order: the same bits
    # whichever reduction an adapter takes, so peers stay comparable bit for bit.
    rng = np.random.default_rng(24)
    x, wg, wu, wd = ffn_block(rng, 3, 512, 256)
    raws = _raws(rng, fmt, wg, wu, wd)
    ys = []
    for subgroups in (False, True):
        gpu = new_gpu(workgroup_size=32, lanes=8, subgroups=subgroups)
        ys.append(gpu.ffn(x, gpu.upload(*raws, fmt)))
    assert np.array_equal(ys[0], ys[1])
    assert rel_error(ys[0], K.swiglu_ffn_f64(x, *(_gguf_f64(r, fmt) for r in raws))) <= 1e-5


def test_lanes_must_divide_the_workgroup(new_gpu):
    for lanes in (3, 64):
        with pytest.raises(KernelError, match="lanes"):
            new_gpu(workgroup_size=32, lanes=lanes)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k"])
def test_row_groups_beyond_one_dispatch_dimension(new_gpu, fmt):
    # 4 rows a workgroup (16 lanes of 4): 262148 rows are 65537 groups, folded into y past 65535.
    rows = 4 * 65535 + 8
    assert K.dispatch_grid(rows, 1, 4) == (65535, 2, 1)
    gpu = new_gpu(workgroup_size=16, lanes=4)
    rng = np.random.default_rng(25)
    h = K.block_size(fmt)[0]
    raw = K.random_blocks(rng, rows, h, fmt, 2e-3)
    x = rng.standard_normal((1, h)).astype(np.float32)
    (y,) = gpu.matmul_many([(gpu.upload_linear(raw, fmt), x)])
    assert rel_error(y, x.astype(np.float64) @ _gguf_f64(raw, fmt).T) <= 1e-5


def test_blocks_with_an_unaligned_float_down(gpu):
    # A dense range of 33 rows: gate/up Q4_1 blocks, down [H, 33] cannot be cut into blocks and
    # arrives as float32 (slices.py), so the two kernels run different formats.
    rng = np.random.default_rng(21)
    x, wg, wu, wd = ffn_block(rng, 4, 64, 33)
    rg, ru = K.quantize_blocks(wg, "q4_1"), K.quantize_blocks(wu, "q4_1")
    y = gpu.ffn(x, gpu.upload(rg, ru, wd, "q4_1", down_fmt="f32"))
    ref = K.swiglu_ffn_f64(x, _gguf_f64(rg, "q4_1"), _gguf_f64(ru, "q4_1"), wd)
    assert rel_error(y, ref) <= 1e-5


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_block_parts_under_phone_limits(new_gpu, fmt):
    # Parts of 85 rows of 3 blocks, an odd block count (scale planes at half-word offsets).
    cap = 85 * 3 * {"q4_0": 16, "q8_0": 32}[fmt]  # quant plane bytes of 85 rows of 96 weights
    gpu = new_gpu(max_binding=cap, workgroup_size=16)
    rng = np.random.default_rng(22)
    x, wg, wu, wd = ffn_block(rng, 9, 96, 320)
    raws = [K.quantize_blocks(w, fmt) for w in (wg, wu, wd)]
    w = gpu.upload(*raws, fmt)
    assert len(w.gate.packed.parts) >= 4 and len(w.down.packed.parts) > 1
    assert w.gate.packed.parts[0] == (0, 85)
    y = gpu.ffn(x, w)
    assert gpu.largest_binding <= cap
    assert rel_error(y, K.swiglu_ffn_f64(x, *(_gguf_f64(r, fmt) for r in raws))) <= 1e-5


def test_bad_blocks_are_refused(gpu):
    rng = np.random.default_rng(23)
    x, wg, wu, wd = ffn_block(rng, 2, 64, 32)
    raw = K.quantize_blocks(wg, "q4_0")
    with pytest.raises(KernelError, match="whole 18-byte blocks"):
        gpu.upload(raw[:, :-1].copy(), raw, K.quantize_blocks(wd, "q4_0"), "q4_0")
    with pytest.raises(KernelError, match="multiple of 32"):
        K.quantize_blocks(np.zeros((2, 40), np.float32), "q8_0")
    with pytest.raises(KernelError, match="disagree"):
        gpu.upload(raw, raw, K.quantize_blocks(wg, "q4_0"), "q4_0")


@pytest.mark.parametrize("fmt", K.BLOCK_FORMATS)
def test_block_kernels_decode_the_files_weights_exactly(gpu, fmt):
    # x = the identity: row j of x @ W^T is column j of W, each a sum of one weight and zeros, so
    # any rounding in the GPU's decoding of the blocks shows; gguf-py's dequantize is the oracle.
    rng = np.random.default_rng(31)
    cols = 2 * K.block_size(fmt)[0]
    raw = K.random_blocks(rng, 37, cols, fmt, 2e-3) if fmt in K.K_FORMATS else K.quantize_blocks(
        rng.standard_normal((37, cols)).astype(np.float32), fmt)
    (y,) = gpu.matmul_many([(gpu.upload_linear(raw, fmt), np.eye(cols, dtype=np.float32))])
    assert np.array_equal(y, dequantize(raw, GGMLQuantizationType[fmt.upper()]).T)


@pytest.mark.parametrize("fmt", ["f32", *K.BLOCK_FORMATS])
def test_a_decode_row_has_the_bits_it_has_in_a_batch(gpu, fmt):
    # One row runs kernels built for one row (kernels.DECODE_TB); in a batch it runs those of TB
    # rows. Each row's sum is the same either way, so a sequence's bits do not depend on its batch.
    rng = np.random.default_rng(32)
    x, wg, wu, wd = ffn_block(rng, 5, 512, 256)
    raws = [wg, wu, wd] if fmt == "f32" else _raws(rng, fmt, wg, wu, wd)
    w = gpu.upload(*raws, fmt)
    batch = gpu.ffn(x, w)
    for t in (0, 3):
        assert np.array_equal(gpu.ffn(x[t:t + 1], w)[0], batch[t])


def test_blocks_of_a_request_share_one_submission_and_kept_buffers(new_gpu, monkeypatch):
    """ffn_many runs a request's blocks (a decode step's experts) in one submission and one
    read-back, through buffers and bind groups it keeps: the same blocks' next rows make no bind
    group. Rows of other sizes grow its buffers, up to a decode step's (a prompt's rows get
    buffers of their own), blocks change slots, blocks with no rows compute nothing, a lost device
    drops them; every answer stays bit for bit that of the block alone on another host."""
    gpu, other = new_gpu(), new_gpu()
    rng = np.random.default_rng(41)
    blocks = [ffn_block(rng, 1, 64, 48)[1:] for _ in range(3)]
    ws, alone = [gpu.upload(*b, "f32") for b in blocks], [other.upload(*b, "f32") for b in blocks]
    counts = {"binds": 0, "submits": 0}
    dev = gpu.device
    make, submit = dev.create_bind_group, dev.queue.submit

    def count(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted
    monkeypatch.setattr(dev, "create_bind_group", count("binds", make))
    monkeypatch.setattr(dev.queue, "submit", count("submits", submit))

    def step(rows: list[int], order=(0, 1, 2)) -> dict:
        counts.update(binds=0, submits=0)
        xs = [rng.standard_normal((t, 64), dtype=np.float32) for t in rows]
        got = gpu.ffn_many([(x, ws[i]) for x, i in zip(xs, order)])
        made = dict(counts)
        for x, y, i in zip(xs, got, order):
            assert np.array_equal(y, other.ffn(x, alone[i]))
        return made

    from web_peer.wgpu_host import _FfnScratch

    # kept: a slot of up to 2 rows (x, h, y: 2 · 64 + 48 floats a row), a read-back of up to 4 rows
    monkeypatch.setattr(_FfnScratch, "KEPT_SLOT_BYTES", 2 * 4 * (2 * 64 + 48))
    monkeypatch.setattr(_FfnScratch, "KEPT_READBACK_BYTES", 4 * 4 * 64)
    assert step([1, 1, 1]) == {"binds": 6, "submits": 1}  # swiglu and down a block
    assert step([1, 1, 1]) == {"binds": 0, "submits": 1}
    assert step([2, 1, 1])["submits"] == 1  # slot 0 grows
    assert step([5, 2, 1])["submits"] == 1  # 5 rows: buffers of the request's own; 8 rows read back: too
    assert [cap for cap, _, _ in gpu._ffn_scratch.slots] == [2 * 64, 2 * 64, 64]  # noqa: SLF001
    assert gpu._ffn_scratch.readback_n == 4 * 64  # noqa: SLF001
    step([1, 1, 1])
    assert step([1, 1, 1]) == {"binds": 0, "submits": 1}
    step([2, 1, 3], order=(2, 0, 1))
    assert step([0, 1, 0])["submits"] == 1  # experts no row was routed to
    dev.destroy()
    with pytest.raises(KernelError):
        gpu.ffn_many([(np.ones((1, 64), np.float32), w) for w in ws])
    ws = [gpu.upload(*b, "f32") for b in blocks]  # a fresh device: fresh buffers
    x = rng.standard_normal((1, 64), dtype=np.float32)
    assert all(np.array_equal(y, other.ffn(x, a)) for y, a in zip(gpu.ffn_many([(x, w) for w in ws]), alone))


def test_kept_buffers_stay_bounded_free_dropped_weights_and_a_failed_read_resets(new_gpu, monkeypatch):
    """What ffn_many keeps never holds more than it may: kept slots stop at their budget (the
    rest get buffers of the request's own), a block's bind groups go with its weights (a replan
    that drops them frees them on the GPU), a request of blocks without rows computes nothing on
    a fresh host, and a device lost under the kept buffers is a KernelError with the device
    reset, after which the next request computes the same bits."""
    import gc
    import weakref

    from web_peer.wgpu_host import _FfnScratch

    gpu = new_gpu()
    rng = np.random.default_rng(43)
    x, wg, wu, wd = ffn_block(rng, 1, 64, 48)
    first = gpu.upload(wg, wu, wd, "f32")
    assert [y.shape for y in gpu.ffn_many([(np.zeros((0, 64), np.float32), first)])] == [(0, 64)]
    monkeypatch.setattr(_FfnScratch, "KEPT_BYTES", 2 * 4 * (2 * 64 + 48))  # two one-row slots
    want = gpu.ffn(x, first)
    got = gpu.ffn_many([(x, first)] * 3)
    assert all(np.array_equal(y, want) for y in got)
    assert [bool(bufs) for _, _, bufs in gpu._ffn_scratch.slots] == [True, True, False]  # noqa: SLF001
    assert gpu._ffn_scratch.kept <= _FfnScratch.KEPT_BYTES  # noqa: SLF001
    assert first.binds  # kept with the weights
    held = weakref.ref(first.gate.buffers[0])
    del first
    gc.collect()
    assert held() is None  # nothing the host keeps holds dropped weights
    w = gpu.upload(wg, wu, wd, "f32")
    assert np.array_equal(gpu.ffn_many([(x, w)])[0], want)
    for _ in range(2):  # the GPU goes away under kept buffers; then once more on the fresh device
        gpu.device.destroy()
        with pytest.raises(KernelError):
            gpu.ffn_many([(x, w)])
        w = gpu.upload(wg, wu, wd, "f32")  # on a fresh device, with fresh kept buffers
        assert np.array_equal(gpu.ffn_many([(x, w)])[0], want)
