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
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KILN_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KILN_CLONES
#endif

/* KILN_SOURCE_HASH is set by the build: the loader checks the library it opens was built from this
 * file as it is now. */
#ifndef KILN_SOURCE_HASH
#define KILN_SOURCE_HASH "unknown"
#endif
const char *kiln_cpu_source_hash(void) { return KILN_SOURCE_HASH; }

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* m ? a : b, lane by lane (m: all ones or all zeros per lane) */
static inline v8f pick(v8i m, v8f a, v8f b) { return (v8f)(((v8i)a & m) | ((v8i)b & ~m)); }

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

/* 8 floats from p; fewer (the rest zeros) where a row ends before: n = floats left in the row. Whole
 * vectors are one unaligned load (a constant-size memcpy); only a row's tail takes the copy. */
static inline v8f load8(const float *p, int64_t n) {
    v8f v;
    if (n >= 8) {
        memcpy(&v, p, sizeof v);
    } else {
        float t[8] = {0};
        memcpy(t, p, (size_t)n * sizeof(float));
        memcpy(&v, t, sizeof v);
    }
    return v;
}

static inline void store8(float *p, v8f v, int64_t n) {
    if (n >= 8) {
        memcpy(p, &v, sizeof v);
    } else {
        float t[8];
        memcpy(t, &v, sizeof v);
        memcpy(p, t, (size_t)n * sizeof(float));
    }
}

/* y = fake_quant(x): an activation or a new key/value row as the fp8 GEMM or fp8 KV cache sees it. */
KILN_CLONES
void kiln_fake_quant_fp8(const float *x, int64_t stride, float *y, int64_t rows, int64_t cols, float scale) {
    const v8f s = splat(scale);
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        float *yr = y + r * cols;
        for (int64_t j = 0; j < cols; j += 8)
            store8(yr + j, fake_quant8(load8(xr + j, cols - j), s), cols - j);
    }
}

/* y = fake_quant(a * b): SwiGLU's product (silu(gate) from PyTorch, up a column slice of the fused
 * gate_up output) quantized for the down projection, the product rounded to float32 first. */
KILN_CLONES
void kiln_mul_fake_quant_fp8(const float *a, int64_t a_stride, const float *b, int64_t b_stride, float *y,
                             int64_t rows, int64_t cols, float scale) {
    const v8f s = splat(scale);
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
               int64_t heads, int64_t dim) {
    const int64_t half = dim / 2;
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
