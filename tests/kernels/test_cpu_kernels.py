"""The CPU kernels (plugins/cpu) against their PyTorch references, bit for bit, and how they are built
and loaded (test_cpu_kernels_engine.py runs the engine with and without them).

The kernels are compiled here by the machine's C compiler (a fraction of a second, cached by source
hash); a machine without one runs the references: the same engine (test_cpu_kernels_engine.py)."""
from __future__ import annotations

import subprocess

import pytest
import torch

from plugins.cpu import build, ops
from plugins.reference import cpu as ref

# The kernels must be built and loaded wherever the suite runs (CI has gcc): a test that silently
# compared the references with themselves would pass without them.
LIB = ops.library()
assert LIB is not None, "plugins/cpu: the CPU kernels did not build or load (see the warning above)"


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _same(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None, "the kernel refused a layout it should take"
    assert got.shape == want.shape and got.dtype == torch.float32
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    diff = (_bits(got) != _bits(want)) & ~nan
    assert not bool(diff.any()), f"{int(diff.sum())} values differ, e.g. {got[diff][:4]} vs {want[diff][:4]}"


def _every_float_pattern(n: int, seed: int) -> torch.Tensor:
    """``n`` float32 bit patterns drawn uniformly: every exponent, subnormals, infinities and NaNs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.7, 2.0 ** -10, 1e-30, 5000.0])
def test_fake_quant_gives_the_reference_bits_for_every_kind_of_value(scale):
    s = torch.tensor(scale)
    x = torch.cat([_every_float_pattern(1 << 20, 0),
                   # the e4m3 grid and the midpoints between its values (ties to even), saturation
                   torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().nan_to_num(0.0) * scale,
                   torch.linspace(-500, 500, 100003) * scale,
                   torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, -464.0, 2 ** -9, 2 ** -10, 3 * 2 ** -11]) * scale])
    _same(ops.fake_quant_fp8(x, s), ref.fake_quant_fp8_ref(x, s))
    _same(ops.fake_quant_fp8(x, scale), ref.fake_quant_fp8_ref(x, s))   # the scale as a float


@pytest.mark.parametrize("cols", [1, 7, 8, 9, 13, 576])
def test_fake_quant_reads_strided_rows_and_row_tails(cols):
    g = torch.Generator().manual_seed(cols)
    s = torch.tensor(0.05)
    qkv = torch.randn(5, 3 * cols, generator=g) * 20
    for x in (qkv[:, cols:2 * cols], qkv[:1, :cols], qkv[:0, :cols], qkv.view(5, 3, cols)[:, 1:]):
        _same(ops.fake_quant_fp8(x, s), ref.fake_quant_fp8_ref(x, s))
    _same(ops.fake_quant_fp8(qkv[0], s), ref.fake_quant_fp8_ref(qkv[0], s))   # 1-D


def test_the_fp8_kv_write_is_fake_quant_then_index_copy_bit_for_bit():
    """k and v rows (strided: columns of a fused qkv) fake-quantized into the float caches at their
    slots in one call, a slot of -1 skipped; every other cache row untouched."""
    g = torch.Generator().manual_seed(2)
    hkv, d, slots_total = 3, 64, 40
    qkv = torch.randn(6, 9 * d, generator=g) * 30
    k, v = qkv[:, 3 * d:6 * d].view(6, hkv, d), qkv[:, 6 * d:].view(6, hkv, d)
    slots = torch.tensor([7, 0, 39, -1, 12, 13])
    ks, vs = torch.tensor(0.05), torch.tensor(0.3)
    k_cache, v_cache = (torch.randn(slots_total, hkv, d, generator=g) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    want_k.index_copy_(0, slots[keep], ref.fake_quant_fp8_ref(k[keep], ks))
    want_v.index_copy_(0, slots[keep], ref.fake_quant_fp8_ref(v[keep], vs))
    assert ops.write_kv_fp8(k, v, k_cache, v_cache, slots, float(ks), float(vs))
    _same(k_cache, want_k)
    _same(v_cache, want_v)
    # layouts it does not take: nothing written, the caller's ops run
    assert not ops.write_kv_fp8(k, v, k_cache, v_cache, slots.int(), 0.05, 0.3)             # int32 slots
    assert not ops.write_kv_fp8(k, v, k_cache[:, :2], v_cache[:, :2], slots, 0.05, 0.3)    # row size differs
    assert not ops.write_kv_fp8(k.bfloat16(), v.bfloat16(), k_cache, v_cache, slots, 0.05, 0.3)


def test_mul_fake_quant_gives_the_reference_bits():
    g = torch.Generator().manual_seed(1)
    s = torch.tensor(0.02)
    for t, n in ((1, 1536), (16, 1536), (3, 13), (0, 8)):
        gate_up = torch.randn(t, 2 * n, generator=g) * 4
        a = torch.nn.functional.silu(gate_up[:, :n])
        b = gate_up[:, n:]
        _same(ops.mul_fake_quant_fp8(a, b, s), ref.mul_fake_quant_fp8_ref(a, b, s))


@pytest.mark.parametrize("head_dim", [64, 16, 6, 2])
def test_rope_gives_the_reference_bits(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    for t in (1, 7):
        qkv = torch.randn(t, (9 + 3 + 3) * head_dim, generator=g) * 3
        x = qkv[:, :12 * head_dim].view(t, 12, head_dim)        # q | k of a fused qkv: strided rows
        angles = torch.randn(t, head_dim, generator=g) * 100
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        _same(ops.rope(x, cos, sin), ref.rope_ref(x, cos, sin))


@pytest.mark.parametrize("cols", [8, 13, 64, 576, 1536, 2048, 4100, 8192])
def test_add_rms_norm_gives_the_reference_bits(cols):
    """The norm's sum of squares is added in ATen's order (kernels.c: torch_sum_sq), so every row
    count and width gives F.rms_norm's bits: widths below and above one cascade level (16 groups of 4
    vectors = 512 floats), a scalar tail, and row counts on both sides of ATen's serial threshold."""
    g = torch.Generator().manual_seed(cols)
    for rows in (1, 2, 3, 16, 33):
        mag = 10.0 ** float(torch.empty(()).uniform_(-4, 4, generator=g))
        qkv = torch.randn(rows, 2 * cols, generator=g) * mag
        x, delta = qkv[:, :cols], torch.randn(rows, cols, generator=g) * mag   # x: strided rows
        w, s = torch.randn(cols, generator=g), torch.tensor(0.03)
        for d, scale in ((None, None), (delta, None), (None, s), (delta, 0.5)):
            got, want = ops.add_rms_norm(x, d, w, 1e-6, scale), ref.add_rms_norm_ref(x, d, w, 1e-6, scale)
            assert got is not None, (rows, cols)
            _same(got[0], want[0].contiguous())
            _same(got[1], want[1])


def test_the_row_kernels_share_a_prefill_sized_call_between_threads_with_the_same_bits():
    """From ATen's grain (32768 elements) up, the elementwise kernels share a call's rows out between
    PyTorch's threads, each row computed whole by one: a prefill's call gives the reference's bits on
    one thread and on two; a decode step's (16 rows) stays on the calling thread."""
    assert LIB.kiln_row_threads(300, 576, 2) == 2 and LIB.kiln_row_threads(300, 576, 1) == 1
    assert LIB.kiln_row_threads(16, 576, 2) == 1 and LIB.kiln_row_threads(1, 1 << 20, 2) == 1
    g = torch.Generator().manual_seed(9)
    t, hkv, d, n = 300, 3, 64, 1536
    qkv = torch.randn(t, 15 * d, generator=g) * 3                 # q | k | v of a fused qkv: strided rows
    gate_up = torch.randn(t, 2 * n, generator=g) * 4
    a, b = torch.nn.functional.silu(gate_up[:, :n]), gate_up[:, n:]
    x, delta, w = qkv[:, :9 * d], torch.randn(t, 9 * d, generator=g), torch.randn(9 * d, generator=g)
    angles = torch.randn(t, d, generator=g) * 100
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    k, v = qkv[:, 9 * d:12 * d].view(t, hkv, d), qkv[:, 12 * d:].view(t, hkv, d)
    slots = torch.randperm(2 * t, generator=g)[:t]
    s = torch.tensor(0.02)
    want_k, want_v = torch.zeros(2 * t, hkv, d), torch.zeros(2 * t, hkv, d)
    want_k.index_copy_(0, slots, ref.fake_quant_fp8_ref(k, s))
    want_v.index_copy_(0, slots, ref.fake_quant_fp8_ref(v, s))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            _same(ops.fake_quant_fp8(x, s), ref.fake_quant_fp8_ref(x, s))
            _same(ops.mul_fake_quant_fp8(a, b, s), ref.mul_fake_quant_fp8_ref(a, b, s))
            rq = qkv[:, :12 * d].view(t, 12, d)
            _same(ops.rope(rq, cos, sin), ref.rope_ref(rq, cos, sin))
            got, want = ops.add_rms_norm(x, delta, w, 1e-6, s), ref.add_rms_norm_ref(x, delta, w, 1e-6, s)
            _same(got[0], want[0].contiguous())
            _same(got[1], want[1])
            k_cache, v_cache = torch.zeros(2 * t, hkv, d), torch.zeros(2 * t, hkv, d)
            assert ops.write_kv_fp8(k, v, k_cache, v_cache, slots, float(s), float(s))
            _same(k_cache, want_k)
            _same(v_cache, want_v)
    finally:
        torch.set_num_threads(before)


def test_add_rms_norm_leaves_rows_aten_would_split_between_threads_to_pytorch():
    """One row of 40000 floats: ATen sums it in one piece on one thread (the kernel's bits) and in
    pieces on two (another order: the kernel declines and PyTorch runs)."""
    x, w = torch.randn(1, 40000), torch.randn(40000)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _same(ops.add_rms_norm(x, None, w, 1e-5)[1], ref.add_rms_norm_ref(x, None, w, 1e-5)[1])
        torch.set_num_threads(2)
        assert ops.add_rms_norm(x, None, w, 1e-5) is None
        assert ops.add_rms_norm(torch.randn(2, 40000), None, w, 1e-5) is not None   # a row each
    finally:
        torch.set_num_threads(before)
    assert ops.add_rms_norm(torch.randn(4, 7), None, torch.randn(7), 1e-5) is None   # narrower than a vector


def _attention_case(seed: int, hq: int = 9, hkv: int = 3, d: int = 64, bs: int = 16, blocks: int = 64):
    """Random float32 caches and block tables for three sequences: a 40-token prefill from position 0,
    a decode row at position 100 and a 5-token step at position 50 (a token tree when asked)."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(blocks, bs, hkv, d, generator=g) for _ in range(2))
    tables = torch.stack([torch.randperm(blocks, generator=g)[:12] for _ in range(3)]).to(torch.int32)
    qsl, ctx = [0, 40, 41, 46], [0, 100, 50]
    q = torch.randn(qsl[-1], hq + 2 * hkv, d, generator=g)[:, :hq]    # rows strided: a fused q|k|v
    return q, k, v, tables, qsl, ctx


def _attention_f64(q, k, v, tables, rows, tree, scale):
    """Each row's softmax(q k^T * scale) v in float64 over the keys it sees."""
    hq, hkv, d = q.shape[1], k.shape[2], k.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        i, pos, c = rows[:, t].tolist()
        ks, vs = (x.index_select(0, tables[i].long()).view(-1, hkv, d)[:pos + 1] for x in (k, v))
        seen = torch.ones(pos + 1, dtype=torch.bool)
        if tree is not None:
            seen[c:] = tree[t, :pos + 1 - c]
        ks, vs = (x.repeat_interleave(hq // hkv, 1)[seen].double() for x in (ks, vs))
        w = (torch.einsum("hd,khd->hk", q[t].double(), ks) * scale).softmax(-1)
        out[t] = torch.einsum("hk,khd->hd", w, vs)
    return out


@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 8, 128), (4, 1, 32), (6, 2, 24)])
def test_paged_attention_is_float64_attention_to_float32_rounding(shape):
    """Prefill, decode and token-tree rows of one call against float64 attention: GQA groups of 3, 1
    and 4, head sizes with the unrolled (64, 128) and the general loops (32, 24)."""
    hq, hkv, d = shape
    q, k, v, tables, qsl, ctx = _attention_case(d, hq, hkv, d)
    rows = ops.attention_rows(qsl, ctx)
    tree = torch.zeros(q.shape[0], 40, dtype=torch.bool)
    for t in range(q.shape[0]):
        i = max(j for j in range(3) if qsl[j] <= t)
        tree[t, :t - qsl[i] + 1] = True
    tree[43, 1] = tree[45, 2] = tree[45, 3] = False        # seq 2: two branches off its first token
    for tr in (None, tree):
        got = ops.paged_attention(q, k, v, tables, rows, tr, 0.125)
        assert got is not None and got.shape == q.shape
        want = _attention_f64(q, k, v, tables, rows, tr, 0.125)
        assert float((got.double() - want).abs().max()) < 2e-6


def test_a_rows_attention_depends_on_nothing_but_its_keys():
    """Bit for bit: a row alone equals the row among others (batch invariance by construction), in
    other blocks of the cache, and a token tree's row equals the same tokens decoded one at a time
    (the hidden keys left out, the keys it sees in the same lanes)."""
    q, k, v, tables, qsl, ctx = _attention_case(1)
    rows = ops.attention_rows(qsl, ctx)
    full = ops.paged_attention(q, k, v, tables, rows, None, 0.125)
    # the decode row (token 40) alone
    alone = ops.paged_attention(q[40:41], k, v, tables[1:2], ops.attention_rows([0, 1], [100]), None, 0.125)
    assert torch.equal(alone[0], full[40])
    # prefill row 17 as a decode row at its position, its blocks moved elsewhere in the cache
    moved = torch.roll(tables[:1], 1, dims=1)
    k2, v2 = k.clone(), v.clone()
    k2[moved[0].long()], v2[moved[0].long()] = k[tables[0].long()], v[tables[0].long()]
    decode = ops.paged_attention(q[17:18], k2, v2, moved, ops.attention_rows([0, 1], [17]), None, 0.125)
    assert torch.equal(decode[0], full[17])
    # a tree step of 4 tokens at position 50: token 3 sees its ancestors 0 and 2 (token 1 is a sibling
    # branch). The same tokens decoded one by one: token 2 at position 51, token 3 at 52.
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    tq = q[41:45]
    tree_out = ops.paged_attention(tq, k, v, tables[2:3], ops.attention_rows([0, 4], [50]), tree, 0.125)
    chain_k, chain_v = k.clone(), v.clone()
    flat = lambda x: x.view(-1, *x.shape[2:])    # noqa: E731 - [blocks * block_size, heads, d]
    slots = [int(tables[2, p // 16]) * 16 + p % 16 for p in (50, 51, 52, 53)]
    for x, y in ((chain_k, k), (chain_v, v)):
        flat(x)[slots[1]] = flat(y)[slots[2]]    # token 2's key and value where a chain puts them
        flat(x)[slots[2]] = flat(y)[slots[3]]    # then token 3's
    chain = ops.paged_attention(tq[[0, 2, 3]], chain_k, chain_v, tables[2:3], ops.attention_rows([0, 3], [50]),
                                None, 0.125)
    assert torch.equal(chain[2], tree_out[3]) and torch.equal(chain[1], tree_out[2])


@pytest.mark.parametrize("case", ["prefill", "decode"])
def test_attention_shares_a_call_between_threads_with_the_same_bits(case):
    """A long prefill's rows, or a decode step's sequences, are shared out between PyTorch's threads
    (the kernel's own OpenMP split, by keys read); every (row, KV head) is computed whole by one
    thread, so one thread and two give the same bits. A call too small to be worth a fork runs on one."""
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(40, 16, 3, 64, generator=g) for _ in range(2))
    if case == "prefill":
        tables = torch.randperm(40, generator=g)[:38].view(1, 38).to(torch.int32)
        q, rows = torch.randn(600, 9, 64, generator=g), ops.attention_rows([0, 600], [0])
    else:   # 16 sequences decoding one token each at positions 10-25 (two blocks of 16 each)
        tables = torch.randperm(40, generator=g)[:32].view(16, 2).to(torch.int32)
        ctx = [10 + i for i in range(16)]
        q, rows = torch.randn(16, 9, 64, generator=g), ops.attention_rows(list(range(17)), ctx)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.paged_attention(q, k, v, tables, rows, None, 0.125)
        assert ops.last_attention_threads == 1
        torch.set_num_threads(2)
        two = ops.paged_attention(q, k, v, tables, rows, None, 0.125)
        assert ops.last_attention_threads == 2
        ops.paged_attention(q[:1], k, v, tables[:1], ops.attention_rows([0, 1], [5]), None, 0.125)
        assert ops.last_attention_threads == 1        # 6 keys x 3 heads: not worth a fork
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_layouts_and_dtypes_the_kernels_do_not_take_return_none():
    x = torch.randn(4, 6, 8)
    s = torch.tensor(0.1)
    assert ops.fake_quant_fp8(x.bfloat16(), s) is None
    assert ops.fake_quant_fp8(x.transpose(1, 2), s) is None           # inner dims not contiguous
    assert ops.mul_fake_quant_fp8(x, x[:, :3], s) is None               # shapes differ
    assert ops.rope(x.transpose(0, 1), x[:, :1], x[:, :1]) is None       # heads not contiguous in a row
    assert ops.rope(x, x[:, :1].transpose(0, 2), x[:, :1]) is None       # cos not contiguous
    q, k, v, tables, qsl, ctx = _attention_case(2)
    rows = ops.attention_rows(qsl, ctx)
    assert ops.paged_attention(q.bfloat16(), k, v, tables, rows, None, 0.1) is None       # bf16 compute
    assert ops.paged_attention(q, k.to(torch.float8_e4m3fn), v, tables, rows, None, 0.1) is None   # fp8 bytes
    assert ops.paged_attention(q, k, v, tables.long(), rows, None, 0.1) is None           # int64 tables
    assert ops.paged_attention(q[:, :, :60], k[..., :60], v[..., :60], tables, rows, None, 0.1) is None  # d % 8


def test_a_library_built_from_other_source_is_refused(tmp_path):
    out = tmp_path / "other.so"
    subprocess.run([build.compiler(), *build.FLAGS, '-DKILN_SOURCE_HASH="0000"', *map(str, build.SOURCES),
                    "-o", str(out)], check=True)
    with pytest.raises(build.CpuKernelBuildError, match="built from source 0000"):
        build._open(out)


def test_no_compiler_is_a_clear_error_and_the_loader_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(build.ENV_DIR, str(tmp_path))                    # an empty cache: must compile
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(build.CpuKernelBuildError, match="no-such-cc"):
        build.ensure()
    monkeypatch.setattr(build, "_loaded", [])
    assert build.load() is None
    assert "CPU kernels not loaded" in caplog.text
    assert not list(tmp_path.iterdir())                                  # no half-written library left
    monkeypatch.setattr(build, "_loaded", [])
    monkeypatch.setenv(build.ENV_DISABLE, "0")
    monkeypatch.delenv("CC")
    assert build.load() is None                                          # disabled: not even built


def test_a_compiler_without_openmp_builds_the_same_kernels_on_one_thread(tmp_path, monkeypatch, caplog):
    """CC without OpenMP (here: a wrapper that refuses -fopenmp, as clang without libomp fails to link
    it): the library is built without it, says so, runs on one thread, and gives the same bits."""
    cc = tmp_path / "cc-without-openmp"
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "no OpenMP here" >&2; exit 1; }}; '
                  f'done\nexec {build.compiler()} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv(build.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    serial = build._open(build.ensure())
    assert "built without OpenMP" in caplog.text and "no OpenMP here" in caplog.text
    assert serial.kiln_cpu_threaded() == 0 and ops.library().kiln_cpu_threaded() == 1
    q, k, v, tables, qsl, ctx = _attention_case(6)
    rows = ops.attention_rows(qsl, ctx)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = ops.paged_attention(q, k, v, tables, rows, None, 0.1)
        with ops.using(serial):
            got = ops.paged_attention(q, k, v, tables, rows, None, 0.1)
            assert ops.last_attention_threads == 1
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    from plugins.cpu import gemm
    if gemm.available():     # the GEMM too: its whole M x N on one thread, the same bits
        codes = (torch.randn(96, 64) * 3).to(torch.float8_e4m3fn)
        panels, fmt = gemm.pack(codes)
        x, y = torch.randn(40, 64), torch.full((40, 96), float("nan"))
        assert serial.kiln_gemm(x.data_ptr(), 40, 64, panels.data_ptr(), fmt, 96, y.data_ptr(), None, 256.0, 2) == 0
        assert torch.equal(y, gemm.gemm(x, panels, fmt, 96, threads=2))


def test_the_cache_is_filled_once_and_named_by_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv(build.ENV_DIR, str(tmp_path))
    path = build.ensure()
    assert path.parent == tmp_path and build.source_hash() in path.name
    mtime = path.stat().st_mtime_ns
    assert build.ensure() == path and path.stat().st_mtime_ns == mtime  # cached: not compiled again
    assert build._open(path).kiln_cpu_source_hash() == build.source_hash().encode()
