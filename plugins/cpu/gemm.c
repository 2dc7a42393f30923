/* Kiln's CPU GEMM: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k], float32 activations and sums, the
 * weight stored as fp16 values or fp8 e4m3 codes in panels of 16 output columns ([K][16], k-major),
 * widened to float32 in registers. AVX-512 only (kiln_gemm_available says whether this CPU has it);
 * elsewhere backend/ops/cpu_matmul.py keeps FBGEMM's fp16 GEMM.
 *
 * Why not FBGEMM's fp16 GEMM, which this replaces on AVX-512: the same sums in the same order (one
 * float32 FMA per k, k ascending, from zero; tests/kernels/test_cpu_gemm.py checks the bits against
 * it), but (1) fp8 bundles' weights stay one byte each instead of two, half the bytes a decode step
 * reads; (2) the per-output-row scale of quantized weights is applied in the store instead of by
 * one more PyTorch op per linear; (3) few rows run several panels at once so that the FMA chains of
 * one row (one per output vector, k after k) do not wait on each other's latency.
 *
 * Batch invariance (docs/contracts.md) holds by construction: every output is one chain of FMAs over
 * k in order, whatever the row count, the blocking chosen for it, or the thread that runs it.
 *
 * e4m3 codes are widened through fp16 bit patterns: a code's 7 magnitude bits shifted left by 7 are
 * the fp16 encoding of value * 2^-8, for normal and subnormal codes alike (e4m3's exponent bias is 7,
 * fp16's 15); the sign moves from bit 7 to bit 15. The 2^8 is folded into the scale the caller passes
 * (a power of two: exact unless a product underflows float32, which fake-quantized activations cannot
 * reach). Code 0x7f/0xff (NaN) never occurs in a quantized weight. */
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define KILN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define MAX_ACC 28   /* accumulators a block keeps in zmm registers (32 in all: the rest for weights) */
/* weight formats: the two a caller packs, and float32 panels gemm_avx512 widens them into (F32) */
enum { FP16 = 0, E4M3 = 1, F32 = 2 };
static inline int64_t elem_size(int fmt) { return fmt == E4M3 ? 1 : fmt == FP16 ? 2 : 4; }

static inline KILN_AVX512 __m512 widen_f16(const void *w) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
}

static inline KILN_AVX512 __m512 widen_e4m3(const void *w) {
    __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));   /* sign-extended */
    b = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16((short)0xBF80));
    return _mm512_cvtph_ps(b);
}

/* One block: MR rows x NP panels (NP * 16 columns), K in full. w: the first panel; panels are
 * K * 16 elements apart. Inlined with constant MR, NP and FMT, so acc lives in registers. */
static inline __attribute__((always_inline)) KILN_AVX512 void block(
        const int MR, const int NP, const int FMT, const float *x, int64_t ldx, const uint8_t *w,
        int64_t K, float *y, int64_t ldy, const __mmask16 *nm, const __m512 *sc) {
    const int64_t pstride = K * 16 * elem_size(FMT);
    __m512 acc[MAX_ACC];
#pragma GCC unroll 28
    for (int i = 0; i < MR * NP; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 wv[4];
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++)
            wv[p] = FMT == E4M3 ? widen_e4m3(w + p * pstride + k * 16)
                    : FMT == FP16 ? widen_f16(w + p * pstride + k * 32)
                                  : _mm512_loadu_ps((const float *)(w + p * pstride) + k * 16);
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++) acc[r * NP + p] = _mm512_fmadd_ps(xv, wv[p], acc[r * NP + p]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++)
            _mm512_mask_storeu_ps(y + r * ldy + p * 16, nm[p], _mm512_mul_ps(acc[r * NP + p], sc[p]));
}

typedef void (*block_fn)(const float *, int64_t, const uint8_t *, int64_t, float *, int64_t, const __mmask16 *,
                         const __m512 *);

#define BLK(MR, NP, FMT)                                                                                      \
    static KILN_AVX512 void b_##MR##_##NP##_##FMT(const float *x, int64_t ldx, const uint8_t *w, int64_t K,    \
                                                  float *y, int64_t ldy, const __mmask16 *nm, const __m512 *sc) { \
        block(MR, NP, FMT, x, ldx, w, K, y, ldy, nm, sc);                                                     \
    }
/* NP = 4 up to 7 rows, NP = 2 up to 14, NP = 1 up to 16 (MR * NP <= MAX_ACC) */
#define ROWS7(NP, FMT) BLK(1, NP, FMT) BLK(2, NP, FMT) BLK(3, NP, FMT) BLK(4, NP, FMT) BLK(5, NP, FMT) \
    BLK(6, NP, FMT) BLK(7, NP, FMT)
#define ROWS14(NP, FMT) ROWS7(NP, FMT) BLK(8, NP, FMT) BLK(9, NP, FMT) BLK(10, NP, FMT) BLK(11, NP, FMT) \
    BLK(12, NP, FMT) BLK(13, NP, FMT) BLK(14, NP, FMT)
#define ROWS16(NP, FMT) ROWS14(NP, FMT) BLK(15, NP, FMT) BLK(16, NP, FMT)
ROWS7(4, 0) ROWS7(4, 1) ROWS14(2, 0) ROWS14(2, 1) ROWS14(2, 2) ROWS16(1, 0) ROWS16(1, 1) ROWS16(1, 2)

#define T7(NP, FMT) {0, b_1_##NP##_##FMT, b_2_##NP##_##FMT, b_3_##NP##_##FMT, b_4_##NP##_##FMT, \
    b_5_##NP##_##FMT, b_6_##NP##_##FMT, b_7_##NP##_##FMT}
#define T14(NP, FMT) {0, b_1_##NP##_##FMT, b_2_##NP##_##FMT, b_3_##NP##_##FMT, b_4_##NP##_##FMT, \
    b_5_##NP##_##FMT, b_6_##NP##_##FMT, b_7_##NP##_##FMT, b_8_##NP##_##FMT, b_9_##NP##_##FMT, \
    b_10_##NP##_##FMT, b_11_##NP##_##FMT, b_12_##NP##_##FMT, b_13_##NP##_##FMT, b_14_##NP##_##FMT}
#define T16(NP, FMT) {0, b_1_##NP##_##FMT, b_2_##NP##_##FMT, b_3_##NP##_##FMT, b_4_##NP##_##FMT, \
    b_5_##NP##_##FMT, b_6_##NP##_##FMT, b_7_##NP##_##FMT, b_8_##NP##_##FMT, b_9_##NP##_##FMT, \
    b_10_##NP##_##FMT, b_11_##NP##_##FMT, b_12_##NP##_##FMT, b_13_##NP##_##FMT, b_14_##NP##_##FMT, \
    b_15_##NP##_##FMT, b_16_##NP##_##FMT}
static const block_fn NP4[2][8] = {T7(4, 0), T7(4, 1)};   /* F32 never takes 4 panels (few rows) */
static const block_fn NP2[3][15] = {T14(2, 0), T14(2, 1), T14(2, 2)};
static const block_fn NP1[3][17] = {T16(1, 0), T16(1, 1), T16(1, 2)};

/* The block shape for M rows: the most rows a block takes at that panel count, and the panel count.
 * Few rows take more panels (independent FMA chains hide the FMA latency); 15-16 rows one panel (one
 * weight widening per 16 FMAs); more rows run in blocks of 14 over two panels. */
static inline int panels_for(int64_t M) { return M <= 7 ? 4 : (M <= 14 || M > 16) ? 2 : 1; }
static inline int rows_for(int np) { return np == 4 ? 7 : np == 2 ? 14 : 16; }

/* One block: panels [p, p + np) for rows [m0, m0 + mr), mr <= rows_for(np); wp: panel p's weights
 * (in the packed weight, or in a thread's widened copy of its group). */
static KILN_AVX512 void run_block(int fmt, const float *x, int64_t K, const uint8_t *wp, int64_t N, float *y,
                                  const float *scale, float mult, int64_t p, int np, int64_t m0, int64_t mr) {
    __mmask16 nm[4];
    __m512 sc[4];
    for (int i = 0; i < np; i++) {
        int64_t n0 = (p + i) * 16, left = N - n0;
        nm[i] = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        sc[i] = scale ? _mm512_mul_ps(_mm512_maskz_loadu_ps(nm[i], scale + n0), _mm512_set1_ps(mult))
                      : _mm512_set1_ps(mult);
    }
    const block_fn f = np == 4 ? NP4[fmt][mr] : np == 2 ? NP2[fmt][mr] : NP1[fmt][mr];
    f(x + m0 * K, K, wp, K, y + m0 * N + p * 16, N, nm, sc);
}

/* n panels of fmt from src, widened to float32 panels in dst: the same values the blocks would widen. */
static KILN_AVX512 void widen_panels(int fmt, const uint8_t *src, int64_t K, int n, float *dst) {
    for (int64_t i = 0; i < n * K; i++)
        _mm512_storeu_ps(dst + i * 16, fmt == E4M3 ? widen_e4m3(src + i * 16) : widen_f16(src + i * 32));
}

/* Rows are cut into blocks of rows_for(np); panels into groups of np, handed out to threads
 * statically (a thread keeps the same panels, so its share of the weight stays in its cache across
 * row blocks). Row blocks are the outer loop, ROW_BLOCKS at a time, so that those rows of x stay in
 * cache while the panels stream past them. With more rows than one block (prefill), a thread widens
 * its group's panels to float32 once per pass and every block of the pass reads those: the blocks'
 * FMAs then share the ALU with loads only, not with the widening (the same values, so the same bits). */
#define ROW_BLOCKS 8   /* 8 x 14 = 112 rows of x a pass: 0.7 MB at K = 1536 */

/* A thread's widening scratch, kept from call to call and grown when a call needs more (np * K * 16
 * floats: 192 KB at K = 1536). A malloc and free per call asked the kernel for fresh pages each time
 * (glibc gives the top of the heap back on free): 2% of a prefill step went to brk and its page
 * faults. Held until the thread ends; PyTorch's team lives as long as the process. NULL when out of
 * memory: the blocks then widen as they go (the same values). */
static __thread float *tls_wide;
static __thread size_t tls_wide_floats;

static float *wide_scratch(size_t floats) {
    if (floats > tls_wide_floats) {
        free(tls_wide);
        tls_wide = malloc(sizeof(float) * floats);
        tls_wide_floats = tls_wide ? floats : 0;
    }
    return tls_wide;
}

static KILN_AVX512 void gemm_avx512(const float *x, int64_t M, int64_t K, const uint8_t *w, int fmt, int64_t N,
                                    float *y, const float *scale, float mult, int threads) {
    const int np = panels_for(M), rb = rows_for(np);
    const int64_t np_all = (N + 15) / 16, groups = (np_all + np - 1) / np, pass = (int64_t)rb * ROW_BLOCKS;
    const int64_t esz = elem_size(fmt);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* np is 2 whenever M > 16; without the scratch (no memory) the blocks widen as they go */
        float *wide = M > rb ? wide_scratch((size_t)(np * K * 16)) : NULL;
        for (int64_t m1 = 0; m1 < M; m1 += pass) {
            const int64_t m_end = m1 + pass < M ? m1 + pass : M;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) {
                const int64_t p0 = g * np, in_group = np_all - p0 < np ? np_all - p0 : np;
                const uint8_t *src = w + p0 * K * 16 * esz;
                if (wide)
                    widen_panels(fmt, src, K, (int)in_group, wide);
                const int run_fmt = wide ? F32 : fmt;
                const uint8_t *base = wide ? (const uint8_t *)wide : src;
                const int64_t run_esz = wide ? 4 : esz;
                for (int64_t m0 = m1; m0 < m_end; m0 += rb) {
                    const int64_t mr = m_end - m0 < rb ? m_end - m0 : rb;
                    /* a short last group runs as groups of 2 and 1 panels (they take as many rows as np
                     * does, or more) */
                    for (int64_t i = 0; i < in_group;) {
                        const int n = in_group - i >= np ? np : in_group - i >= 2 ? 2 : 1;
                        run_block(run_fmt, x, K, base + i * K * 16 * run_esz, N, y, scale, mult, p0 + i, n, m0,
                                  mr);
                        i += n;
                    }
                }
            }
        }
    }
}
#endif

/* 1 when this CPU runs kiln_gemm (AVX-512 F/BW/VL, F16C, FMA), else 0: callers use FBGEMM then. */
int kiln_gemm_available(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* y [M, N] (rows N floats apart) = (x [M, K] (rows K floats apart) @ W^T) * scale[n] * mult.
 * w: ceil(N / 16) panels of [K][16] elements (fp16 when fmt 0, e4m3 codes when fmt 1; columns past N
 * zero). scale: N floats or NULL (1). mult: 256 for e4m3 (see above), 1 for fp16. threads: OpenMP
 * threads (the process's: PyTorch's own team when it is the same libgomp). Returns 0, or -1 when
 * this CPU cannot run it. */
int kiln_gemm(const float *x, int64_t M, int64_t K, const void *w, int64_t fmt, int64_t N, float *y,
              const float *scale, float mult, int64_t threads) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (!kiln_gemm_available() || (fmt != 0 && fmt != 1)) return -1;
    if (M <= 0 || N <= 0) return 0;
    gemm_avx512(x, M, K, (const uint8_t *)w, (int)fmt, N, y, scale, mult, (int)threads);
    return 0;
#else
    (void)x; (void)M; (void)K; (void)w; (void)fmt; (void)N; (void)y; (void)scale; (void)mult; (void)threads;
    return -1;
#endif
}
