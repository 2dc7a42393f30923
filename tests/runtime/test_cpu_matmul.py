"""The CPU linear path (backend/ops/cpu_matmul.py): the same numbers as F.linear, each storage chosen
only where its values survive it exactly, each kernel taken only where it was measured to win, and
weights converted once, shared rather than copied."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.ops import cpu_matmul
from backend.ops.linear import make_linear

needs_onednn = pytest.mark.skipif(cpu_matmul._DNN is None, reason="this PyTorch build has no oneDNN linear")
needs_fbgemm = pytest.mark.skipif(not cpu_matmul.packs_fp16("cpu", torch.float32),
                                  reason="no packed fp16 GEMM here: this PyTorch build has no FBGEMM (non-x86)")


def fp16_exact(*shape, seed=0):
    """Weights as a bf16 checkpoint's are: every value exactly an fp16."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16).half().float()


@needs_fbgemm
def test_fp16_exact_weights_are_packed_and_give_their_values_back():
    w = fp16_exact(96, 40)
    p = cpu_matmul.prepare(w)
    assert isinstance(p, cpu_matmul.packed_type()) and tuple(p.shape) == (96, 40) and p.dtype == torch.float32
    assert torch.equal(p.unpack(), w)
    assert cpu_matmul.prepare(p) is p  # a shared weight (tied lm_head, draft reusing it) is not packed twice


@needs_fbgemm
def test_preparing_the_same_weight_again_reuses_the_result_while_it_lives_unchanged(monkeypatch):
    """An engine built again from the same weight tensors takes what the first build made of them;
    a weight changed in place, or a storage choice that changed (a kernel turned off), is converted
    anew; the entry goes with its weight."""
    import gc
    w, fp32 = fp16_exact(96, 40), fp16_exact(64, 32, seed=1)
    fp32[0, 0] += 1e-6                     # needs fp32: the column-major copy is remembered too
    p, c = cpu_matmul.prepare(w), cpu_matmul.prepare(fp32)
    assert cpu_matmul.prepare(w) is p and cpu_matmul.prepare(w, exact_fp16=True) is p
    assert cpu_matmul.prepare(fp32) is c or cpu_matmul._DNN is None
    w.mul_(2)                              # in place: the packing of the old values must not be used
    p2 = cpu_matmul.prepare(w)
    assert p2 is not p and torch.equal(p2.unpack(), w)
    monkeypatch.setattr(cpu_matmul, "packed_type", lambda: "another kernel's storage")
    p3 = cpu_matmul.prepare(w)             # (this storage type does not exist: whatever prepare makes now)
    assert p3 is not p2
    monkeypatch.undo()
    with torch.inference_mode():           # no version counter: converted every time, never remembered
        frozen = fp16_exact(32, 16, seed=2)
    assert cpu_matmul.prepare(frozen) is not cpu_matmul.prepare(frozen)
    entries = len(cpu_matmul._PREPARED)
    del w, fp32, p, p2, p3, c
    gc.collect()
    assert len(cpu_matmul._PREPARED) <= entries - 2


def test_an_executor_built_again_over_the_same_weights_shares_their_storage(smollm2_bundle, weights_fp32):
    """What makes the second build cheap: its linears hold the first's packed weights, the same
    objects (a test's executors over shared weights build in a fraction of the first's time)."""
    from backend.runtime.native import ModelRunner
    from backend.runtime.spec import load_engine_spec
    spec = load_engine_spec(smollm2_bundle, {"max_kv_tokens": 256, "max_batch_size": 2})
    a, b = (ModelRunner(spec, dtype=torch.float32, weights=weights_fp32) for _ in range(2))
    la, lb = a.model.layers[3], b.model.layers[3]
    wa, wb = (getattr(getattr(x, "linear", x), "weight") for x in (la.qkv, lb.qkv))
    assert wa is wb and (not cpu_matmul.applies("cpu", torch.float32) or cpu_matmul.is_packed(wa))
    assert a.model.lm_head is b.model.lm_head     # the tied head's own storage, made from the embedding


@needs_onednn
def test_weights_that_need_fp32_go_column_major_not_fp16():
    w = fp16_exact(96, 40)
    w[3, 7] += 1e-6          # one value an fp16 cannot hold: packing would change the model
    p = cpu_matmul.prepare(w)
    assert isinstance(p, torch.Tensor) and cpu_matmul.is_column_major(p) and torch.equal(p, w)
    assert cpu_matmul.prepare(p) is p
    big = fp16_exact(8, 4)
    big[0, 0] = 70000.0      # beyond fp16's range
    assert isinstance(cpu_matmul.prepare(big), torch.Tensor)


def test_prepare_leaves_other_dtypes_and_ranks_alone():
    for w in (torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.float16), torch.randn(8),
              torch.randint(0, 9, (8, 4), dtype=torch.uint8)):
        assert cpu_matmul.prepare(w) is w


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 32, 33, 100])   # 0: a step with no logits rows
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows, exact, bias):
    w = fp16_exact(72, 48, seed=rows)
    if not exact:
        w = w + 1e-6
    b = torch.randn(72) if bias else None
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows))
    got = cpu_matmul.linear(x, cpu_matmul.prepare(w), b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_accepts_leading_batch_dims_and_strided_rows():
    for w in (fp16_exact(24, 16), fp16_exact(24, 16) + 1e-6):
        x = torch.randn(2, 3, 16)
        torch.testing.assert_close(cpu_matmul.linear(x, cpu_matmul.prepare(w)), F.linear(x, w), rtol=1e-5, atol=1e-5)
        xs = torch.randn(6, 32)[:, ::2]   # a non-contiguous view, as split() hands out
        torch.testing.assert_close(cpu_matmul.linear(xs, cpu_matmul.prepare(w)), F.linear(xs, w), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_onednn_takes_every_row_count_of_a_column_major_weight(monkeypatch):
    """One kernel whatever the row count: MKL, which used to take 33 rows and more, sums a row in an
    order that follows the row count (batch invariance, docs/contracts.md)."""
    calls = []
    real = cpu_matmul._DNN
    monkeypatch.setattr(cpu_matmul, "_DNN", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = cpu_matmul.prepare(fp16_exact(16, 8) + 1e-6)
    for rows in (1, 4, 32, 33, 256):
        cpu_matmul.linear(torch.randn(rows, 8), w)
    cpu_matmul.linear(torch.randn(2, 8), torch.randn(16, 8))        # a row-major weight: plain F.linear
    cpu_matmul.linear(torch.randn(2, 8).double(), w.double())       # not float32: plain F.linear
    assert calls == [2, 4, 32, 33, 256]   # one row runs as two: oneDNN's one-row kernel sums differently


@pytest.mark.parametrize("exact", [
    pytest.param(True, marks=needs_fbgemm), pytest.param(False, marks=needs_onednn)])
def test_a_rows_result_does_not_depend_on_the_other_rows(exact):
    """Batch invariance of both CPU kernels, bit for bit: one row alone, or among 2..2048 others,
    gives the same output row (MKL's F.linear does not; nor oneDNN's own one-row kernel)."""
    g = torch.Generator().manual_seed(1)
    w = fp16_exact(576, 1536)   # 1536 inputs: where oneDNN's one-row kernel sums in another order
    if not exact:
        w = w + 1e-6
    p = cpu_matmul.prepare(w)
    assert isinstance(p, cpu_matmul.packed_type()) == exact
    x = torch.randn(2048, 1536, generator=g)
    row = torch.randn(1, 1536, generator=g)
    alone = cpu_matmul.linear(row, p)
    # the last rows too: on AVX2, FBGEMM multiplies the one or two rows left over at the end of 7, 14,
    # 31, 32, 37, 38 ... rows (and 1 or 2 rows alone) with other kernels (cpu_matmul._fp16_rows); the
    # counts it runs unpadded (4, 5, 10, 16, 17, 64, 100 ...) must agree too
    for rows in (2, 3, 4, 5, 7, 8, 10, 11, 13, 14, 16, 17, 31, 32, 33, 38, 64, 100, 512, 2048):
        for at in sorted({rows // 2, rows - 1}):
            batch = x[:rows].clone()
            batch[at] = row[0]
            assert torch.equal(cpu_matmul.linear(batch, p)[at], alone[0]), (rows, at)


def test_bf16_rows_do_not_depend_on_the_other_rows():
    """bf16 compute (engine.cpu_dtype: bfloat16) goes through F.linear, whose single-row kernel sums
    in another order for some inputs (here: 1 of 20 seeds at SmolLM2's down projection shape, and the
    real activations of a decode step): ``linear`` runs one row as two."""
    g = torch.Generator().manual_seed(0)
    for seed in range(20):
        x = torch.randn(9, 1536, generator=g).bfloat16()
        w = (torch.randn(576, 1536, generator=g) * 0.02).bfloat16()
        full = cpu_matmul.linear(x, w)
        assert torch.equal(cpu_matmul.linear(x[:1], w), full[:1]), seed
        assert torch.equal(cpu_matmul.linear(x[0], w), full[0]), seed   # a 1-D row too


def test_fp16_padding_only_where_a_block_of_one_or_two_rows_would_be_left():
    pads = {n: cpu_matmul.fp16_pad_rows(n) for n in range(0, 20)}
    assert pads == {0: 0, 1: 2, 2: 1, 3: 0, 4: 0, 5: 0, 6: 0, 7: 2, 8: 1, 9: 0, 10: 0, 11: 0, 12: 0, 13: 2,
                    14: 1, 15: 0, 16: 0, 17: 0, 18: 0, 19: 2}


@needs_fbgemm
def test_model_linears_take_the_storage_their_values_allow():
    w = fp16_exact(32, 16)
    lin = make_linear("none", {"weight": w, "bias": torch.randn(32)}, torch.float32, "cpu")
    assert isinstance(lin.weight, cpu_matmul.packed_type()) and lin.out_features == 32
    x = torch.randn(3, 16)
    torch.testing.assert_close(lin(x), F.linear(x, w, lin.bias), rtol=1e-5, atol=1e-5)
    # A bf16 checkpoint's weight not exact in fp16 (here: one value changed) stays a tensor.
    assert isinstance(make_linear("none", {"weight": w + 1e-6}, torch.float32, "cpu").weight, torch.Tensor)
    # bf16 compute (a CPU with native bf16, or a test asking for it) keeps the weight as given.
    lin16 = make_linear("none", {"weight": w}, torch.bfloat16, "cpu")
    assert isinstance(lin16.weight, torch.Tensor) and lin16.weight.is_contiguous()


@needs_fbgemm
@pytest.mark.parametrize("fmt", ["fp8", "int8_sq"])
def test_per_row_quantized_linears_multiply_codes_and_scale_rows(fmt):
    """fp8/int8 codes are exact in fp16 while code x scale is not: the codes are packed and the
    output rows scaled, which is the dequantized matmul up to rounding."""
    from backend.ops.linear import fake_quant_fp8
    from quant import formats
    torch.manual_seed(0)
    w, b = torch.randn(48, 32) * 0.1, torch.randn(48)
    if fmt == "fp8":
        t = {**formats.quantize_fp8_per_row(w), "input_scale": torch.tensor(0.02)}
        deq = formats.dequantize_fp8(t["weight"], t["weight_scale"])
        act = lambda x: fake_quant_fp8(x, torch.tensor(0.02))  # noqa: E731
    else:
        q = (w / (w.abs().amax(1, keepdim=True) / 127)).round().clamp(-127, 127).to(torch.int8)
        t = {"weight": q, "weight_scale": w.abs().amax(1) / 127, "input_scale": torch.tensor(0.02)}
        deq = formats.dequantize_int8(q, t["weight_scale"])
        act = lambda x: ((x / 0.02).round().clamp(-128, 127) * 0.02)  # noqa: E731
    lin = make_linear(fmt, {**t, "bias": b}, torch.float32, "cpu")
    assert isinstance(lin.weight, cpu_matmul.packed_type()) and lin.out_scale.shape == (48,)
    if fmt == "fp8" and cpu_matmul.packs_e4m3("cpu", torch.float32):
        assert lin.weight.panels.dtype == torch.uint8     # the codes as they are, one byte each
    x = torch.randn(5, 32)
    torch.testing.assert_close(lin(x), F.linear(act(x), deq, b), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="weight_scale: 3 values; expected 1 or one per output row"):
        make_linear(fmt, {**t, "weight_scale": torch.ones(3)}, torch.float32, "cpu", where="layers.0.o")
    # built again from the same codes: the first build's packed codes, neither widened nor packed again
    again = make_linear(fmt, {**t, "bias": b}, torch.float32, "cpu")
    assert again.weight is lin.weight
    t["weight"].add_(0) if fmt == "int8_sq" else t["weight"].view(torch.uint8).add_(0)   # "changed" in place
    assert make_linear(fmt, {**t, "bias": b}, torch.float32, "cpu").weight is not lin.weight
