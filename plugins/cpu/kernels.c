/* Kiln's CPU kernels: the elementwise steps of a float32 decoder layer that PyTorch runs as several
 * dispatched ops each (fp8 fake quantization is ~13 of them), as one pass.
 *
 * Every kernel gives the bits of its PyTorch reference (plugins/reference/cpu.py): the same IEEE
 * float32 operations in the same order, each rounded (built with -ffp-contract=off, so no FMA fuses a
 * multiply and an add; no fast-math). Tested bit for bit in tests/kernels/test_cpu_kernels.py.
 *
 * Built by plugins/cpu/build.py with the machine's C compiler; loaded with ctypes (no Python or torch
 * headers: a compile takes a fraction of a second). GCC vector extensions, 8 floats at a time: AVX2
 * where the CPU has it (target_clones picks at load), two SSE registers otherwise.
 *
 * Layouts: a "rows" argument is a 2-D float32 array of `rows` rows of `cols` values, its rows `stride`
 * floats apart (a column slice of a fused GEMM output needs no copy); outputs are contiguous.
 */
#include "kiln_cpu.h"

/* KILN_SOURCE_HASH is set by the build: the loader checks the library it opens was built from these
 * files as they are now. */
#ifndef KILN_SOURCE_HASH
#define KILN_SOURCE_HASH "unknown"
#endif
const char *kiln_cpu_source_hash(void) { return KILN_SOURCE_HASH; }

/* 1 when built with OpenMP (the GEMM and attention share work between threads), 0 when not. */
int kiln_cpu_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Every kernel below computes each row whole and alone, so rows can be shared out between threads
 * without changing a bit: with `threads` > 1 (PyTorch's count: the library runs on PyTorch's own
 * OpenMP team, see build.py) and at least PARALLEL_MIN_ELEMS elements in the call, contiguous runs of
 * rows go to the team's threads. A prefill's norms, activations and KV writes (983 rows of SmolLM2:
 * ~0.15 s of a 0.95 s step on one thread) then run on both cores; a decode step's (16 rows, 9-25k
 * elements) stay on the calling thread, where the fork and join would cost what they save. */
#define PARALLEL_MIN_ELEMS 32768   /* ATen's GRAIN_SIZE: PyTorch's own ops go parallel from there too */
#ifdef _OPENMP
#define PARALLEL_ROWS _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)")
#else
#define PARALLEL_ROWS (void)nthreads;
#endif
static inline int row_threads(int64_t rows, int64_t cols, int64_t threads) {
#ifdef _OPENMP
    return rows > 1 && rows * cols >= PARALLEL_MIN_ELEMS && threads > 1 ? (int)(threads < rows ? threads : rows) : 1;
#else
    (void)rows, (void)cols, (void)threads;
    return 1;
#endif
}

/* The threads the kernels below share a call of `rows` x `cols` elements between (tests). */
int kiln_row_threads(int64_t rows, int64_t cols, int64_t threads) { return row_threads(rows, cols, threads); }

/* x / scale to fp8 e4m3 (saturated to +-448, round to nearest even) and back times scale: the bits
 * of PyTorch's ((x / scale).clamp(-448, 448).to(float8_e4m3fn).float() * scale).
 * e4m3 keeps 3 mantissa bits: from 2^-6 up, a float32 is rounded by adding half its dropped 20 bits
 * (less one, plus the kept last bit: ties to even) and clearing them; below 2^-6 (subnormals, steps
 * of 2^-9) adding and subtracting 2^14, whose float32 ulp is 2^-9, rounds to even the same way. NaN
 * stays NaN (passed through: the clamps' comparisons are false for it), +-inf saturates. */
static inline v8f fake_quant8(v8f x, v8f scale) {
    const v8f hi = splat(448.0f), sub_min = splat(0.015625f), magic = splat(16384.0f);
    v8f v = x / scale;
    v = pick(v > hi, hi, v);
    v = pick(v < -hi, -hi, v);
    v8u u = (v8u)v;
    v8u sign = u & 0x80000000u;
    v8u au = u & 0x7FFFFFFFu;
    v8f a = (v8f)au;
    v8f sub = (a + magic) - magic;
    v8u nrm = (au + 0x7FFFFu + ((au >> 20) & 1u)) & ~0xFFFFFu;
    v8u r = (v8u)pick(a < sub_min, sub, (v8f)nrm) | sign;
    return pick(v != v, v, (v8f)r) * scale;     /* NaN: the rounding above may carry out of it */
}

/* y = fake_quant(x): an activation or a new key/value row as the fp8 GEMM or fp8 KV cache sees it. */
KILN_CLONES
void kiln_fake_quant_fp8(const float *x, int64_t stride, float *y, int64_t rows, int64_t cols, float scale,
                         int64_t threads) {
    const v8f s = splat(scale);
    const int nthreads = row_threads(rows, cols, threads);
    PARALLEL_ROWS
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        float *yr = y + r * cols;
        for (int64_t j = 0; j < cols; j += 8)
            store8(yr + j, fake_quant8(load8(xr + j, cols - j), s), cols - j);
    }
}

/* The fp8 KV cache's write on CPU, where the caches are float and hold the fp8-rounded values: row r
 * of k and of v (rows k_stride / v_stride floats apart, cols contiguous) fake-quantized with its
 * scale straight into row slots[r] of k_cache / v_cache ([slots, cols] contiguous); a slot < 0 is
 * not written. The bits of kiln_fake_quant_fp8 followed by index_copy_, in one call instead of four. */
KILN_CLONES
void kiln_write_kv_fp8(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache,
                       float *v_cache, const int64_t *slots, int64_t rows, int64_t cols, float k_scale,
                       float v_scale, int64_t threads) {
    const v8f ks = splat(k_scale), vs = splat(v_scale);
    const int nthreads = row_threads(rows, 2 * cols, threads);   /* slots are distinct: rows never collide */
    PARALLEL_ROWS
    for (int64_t r = 0; r < rows; r++) {
        if (slots[r] < 0)
            continue;
        const float *kr = k + r * k_stride, *vr = v + r * v_stride;
        float *kd = k_cache + slots[r] * cols, *vd = v_cache + slots[r] * cols;
        for (int64_t j = 0; j < cols; j += 8) {
            store8(kd + j, fake_quant8(load8(kr + j, cols - j), ks), cols - j);
            store8(vd + j, fake_quant8(load8(vr + j, cols - j), vs), cols - j);
        }
    }
}

/* y = fake_quant(a * b): SwiGLU's product (silu(gate) from PyTorch, up a column slice of the fused
 * gate_up output) quantized for the down projection, the product rounded to float32 first. */
KILN_CLONES
void kiln_mul_fake_quant_fp8(const float *a, int64_t a_stride, const float *b, int64_t b_stride, float *y,
                             int64_t rows, int64_t cols, float scale, int64_t threads) {
    const v8f s = splat(scale);
    const int nthreads = row_threads(rows, cols, threads);
    PARALLEL_ROWS
    for (int64_t r = 0; r < rows; r++) {
        const float *ar = a + r * a_stride, *br = b + r * b_stride;
        float *yr = y + r * cols;
        for (int64_t j = 0; j < cols; j += 8) {
            int64_t n = cols - j;
            store8(yr + j, fake_quant8(load8(ar + j, n) * load8(br + j, n), s), n);
        }
    }
}

/* Rotary embedding, rotate-half layout: each of a row's `heads` vectors of `dim` (x, rows `stride`
 * floats apart, heads contiguous within a row) -> x * cos + rotate_half(x) * sin, rotate_half(x) =
 * (-x2, x1); cos, sin: [rows, dim] contiguous. Each product rounded, then the sum, as PyTorch's three ops. */
KILN_CLONES
void kiln_rope(const float *x, int64_t stride, const float *cos, const float *sin, float *y, int64_t rows,
               int64_t heads, int64_t dim, int64_t threads) {
    const int64_t half = dim / 2;
    const int nthreads = row_threads(rows, heads * dim, threads);
    PARALLEL_ROWS
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *sn = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + r * stride + h * dim;
            float *yh = y + (r * heads + h) * dim;
            for (int64_t j = 0; j < half; j += 8) {
                int64_t n = half - j;
                v8f x1 = load8(xh + j, n), x2 = load8(xh + half + j, n);
                store8(yh + j, x1 * load8(c + j, n) + (-x2) * load8(sn + j, n), n);
                store8(yh + half + j, x2 * load8(c + half + j, n) + x1 * load8(sn + half + j, n), n);
            }
        }
    }
}

/* PyTorch's float32 sum of a contiguous row of squares, x[i] * x[i] each rounded first (``pow(x, 2)``
 * then ``sum(-1)``), in the order ATen's CPU sum adds them (SumKernel.cpp: ``vectorized_inner_sum``
 * over vectors of 8 floats, ``row_sum``'s four interleaved accumulators, ``multi_row_sum``'s four
 * cascade levels, then the scalar tail and the 8 lanes one by one). The order is what makes the bits:
 * float addition is not associative. 8 lanes is Vectorized<float> on AVX2 and default builds only:
 * plugins/cpu/ops.py uses this where torch.backends.cpu.get_cpu_capability() is one of those. */
static inline v8f sq8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v * v; }

static float torch_sum_sq(const float *x, int64_t n) {
    const int64_t nvec = n / 8, groups = nvec / 4;     /* groups of 4 vectors: row_sum's ilp factor */
    const int64_t ceil_log2 = groups <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(groups - 1));
    const int64_t power = ceil_log2 / 4 > 4 ? ceil_log2 / 4 : 4, step = (int64_t)1 << power, mask = step - 1;
    v8f acc[4][4];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + step <= groups) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                acc[0][k] += sq8(x + (i * 4 + k) * 8);
        for (int lv = 1; lv < 4; lv++) {
            for (int k = 0; k < 4; k++) {
                acc[lv][k] += acc[lv - 1][k];
                acc[lv - 1][k] = splat(0.0f);
            }
            if (i & (mask << (lv * power)))
                break;
        }
    }
    for (; i < groups; i++)
        for (int k = 0; k < 4; k++)
            acc[0][k] += sq8(x + (i * 4 + k) * 8);
    for (int lv = 1; lv < 4; lv++)
        for (int k = 0; k < 4; k++)
            acc[0][k] += acc[lv][k];
    for (int64_t v = groups * 4; v < nvec; v++)
        acc[0][0] += sq8(x + v * 8);
    for (int k = 1; k < 4; k++)
        acc[0][0] += acc[0][k];
    float total = 0.0f, lanes[8];
    for (int64_t e = nvec * 8; e < n; e++)
        total += x[e] * x[e];
    memcpy(lanes, &acc[0][0], sizeof lanes);
    for (int l = 0; l < 8; l++)
        total += lanes[l];
    return total;
}

/* RMSNorm of each row (PyTorch's F.rms_norm in float32: mean = sum(x * x) / cols, r = 1 / sqrt(mean +
 * eps), y = (x * r) * w), optionally after the residual add and before an fp8 GEMM's input quantization:
 *   d != NULL: the row is h = x + d, written to h (the new residual stream), and normed;
 *   quant != 0: y = fake_quant(norm, scale), what the next FP8 linear would make of the norm itself.
 * A decoder layer's two norms, their residual adds and their activation quantizations as one pass
 * (PyTorch: ~12 dispatched ops). x, d: rows `*_stride` floats apart; h, y, w contiguous; cols >= 8. */
KILN_CLONES
void kiln_add_rms_norm(const float *x, int64_t x_stride, const float *d, int64_t d_stride, float *h,
                       const float *w, float *y, int64_t rows, int64_t cols, float eps, int64_t quant,
                       float scale, int64_t threads) {
    const v8f s = splat(scale);
    const int nthreads = row_threads(rows, cols, threads);
    PARALLEL_ROWS
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        if (d) {
            const float *dr = d + r * d_stride;
            float *hr = h + r * cols;
            for (int64_t j = 0; j < cols; j += 8)
                store8(hr + j, load8(xr + j, cols - j) + load8(dr + j, cols - j), cols - j);
            xr = hr;
        }
        const float rstd = 1.0f / __builtin_sqrtf(torch_sum_sq(xr, cols) / (float)cols + eps);
        const v8f rv = splat(rstd);
        float *yr = y + r * cols;
        for (int64_t j = 0; j < cols; j += 8) {
            int64_t n = cols - j;
            v8f v = (load8(xr + j, n) * rv) * load8(w + j, n);
            store8(yr + j, quant ? fake_quant8(v, s) : v, n);
        }
    }
}
