/* Attention over the paged KV cache on CPU, one query row at a time: float32 queries and caches.
 *
 * Why its own kernel: PyTorch's SDPA gives a row numbers that depend on the shape of the call it is in
 * (the batch, the key length), so the PyTorch path (backend/ops/attention/torch_backend.py) pads every
 * row into position-aligned tiles and key-length buckets and gathers the blocks of each sequence into
 * a contiguous copy, every layer. Here a row's numbers follow from its own query, its keys and its
 * position alone, in a fixed order, by construction: prefill rows, decode rows and the rows of a
 * speculative token tree all go through the same loop, so batch invariance (docs/contracts.md) holds
 * whatever the step holds, and nothing is padded, gathered or masked after the fact. The query heads
 * that share a KV head (GQA) read each key and value once.
 *
 * For query row r (sequence row_seq[r], cache position row_pos[r], its step's first position
 * row_ctx[r]) and query head h, over the keys the row sees, in position order: positions 0 ..
 * row_pos[r], less those of the step's own tokens (p >= row_ctx[r]) a token tree hides
 * (tree[r][p - row_ctx[r]] == 0, when a tree is given):
 *   s_p = (q . k_p) * scale       (8 lanes over head_dim added as a tree, then the lanes: hsum8)
 *   w_p = exp8(s_p - max_p s_p)   (Cephes' single-precision exp polynomial, ~1 ulp)
 *   out = (sum_p w_p v_p) / (sum_p w_p)   (p ascending; the weights' sum over 8 lanes, then hsum8)
 * Hidden keys are left out, not weighted 0, so a tree's row adds the keys it sees in the lanes and the
 * order the same tokens decoded one at a time would: the same bits.
 * head_dim a multiple of 8; caches [num_blocks, block_size, kv_heads, head_dim]; block tables int32. */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#else   /* built without OpenMP (build.py's SERIAL_FLAGS): the pragmas are ignored, one thread runs all */
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

#include "kiln_cpu.h"

typedef float v4f __attribute__((vector_size(16)));

/* ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)), in registers (lane extracts went through memory) */
static inline float hsum8(v8f v) {
    v4f x = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    v4f y = x + __builtin_shufflevector(x, x, 1, 0, 3, 2);
    return y[0] + y[2];
}

static inline float hmax8(v8f v) {
    float m = v[0];
    for (int l = 1; l < 8; l++)
        m = v[l] > m ? v[l] : m;
    return m;
}

/* e^x for x <= 0 (a score less the row's largest): x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes'
 * degree-6 polynomial, times 2^n built in the exponent bits. Below -87.3 (and -inf: masked keys) 0. */
static inline v8f exp8(v8f x) {
    const v8f lo = splat(-87.3365447f);
    const v8i under = x < lo;
    x = pick(under, lo, x);
    v8f t = x * splat(1.44269504088896341f) + splat(0.5f);
    v8f n = __builtin_convertvector(__builtin_convertvector(t, v8i), v8f);   /* toward zero ... */
    n = n - pick(n > t, splat(1.0f), splat(0.0f));                            /* ... floor(t) */
    v8f r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    v8f p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    return pick(under, splat(0.0f), p * (v8f)e);
}

/* sum_j a[j] * b[j] over dv vectors of 8, the products added as a balanced tree of adjacent pairs
 * (depth log2 dv, not a chain of dv dependent adds), then the lanes (hsum8). Written out for the common
 * head sizes (64, 128: registers, no loop); the loop for any other dv adds in the same order. */
static inline v8f prod(const float *a, const float *b, int64_t j) { return load8(a + 8 * j, 8) * load8(b + 8 * j, 8); }

static inline v8f tree8(const float *a, const float *b) {
    return ((prod(a, b, 0) + prod(a, b, 1)) + (prod(a, b, 2) + prod(a, b, 3)))
         + ((prod(a, b, 4) + prod(a, b, 5)) + (prod(a, b, 6) + prod(a, b, 7)));
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t dv) {
    if (dv == 8)
        return hsum8(tree8(a, b));
    if (dv == 16)
        return hsum8(tree8(a, b) + tree8(a + 64, b + 64));
    v8f m[dv];
    for (int64_t j = 0; j < dv; j++)
        m[j] = prod(a, b, j);
    for (int64_t w = 1; w < dv; w *= 2)
        for (int64_t j = 0; j + w < dv; j += 2 * w)
            m[j] += m[j + w];
    return hsum8(m[0]);
}

/* One query row's attention for KV head h (its `group` query heads): see the top of the file. s: the
 * group's scores, then weights, `np` floats each; at: the cache offset of each key it sees. The keys a
 * token tree hides are left out, not weighted 0: the keys a row sees are then added in the same lanes,
 * in the same order, as for the same tokens decoded one by one, so a tree's rows get those bits. */
static inline __attribute__((always_inline)) void row_head(
        const float *qh, const float *k_cache, const float *v_cache, const int32_t *table, int64_t n,
        int64_t ctx, const uint8_t *seen, float *o, int64_t group, int64_t kv_heads, int64_t h, int64_t dv,
        int64_t bs, float scale, float *s, int64_t np, int64_t *at) {
    const int64_t d = 8 * dv, row = kv_heads * d;   /* row: one position's floats in a block */
    int64_t seen_n = 0, k = 0;
    for (int64_t p = 0, off = bs; p < n; p++, off++) {
        if (off == bs) {   /* the sequence's next block (no division per key) */
            k = ((int64_t)table[p / bs] * bs * kv_heads + h) * d;
            off = 0;
        } else {
            k += row;
        }
        if (seen && p >= ctx && !seen[p - ctx])
            continue;
        at[seen_n] = k;
        for (int64_t g = 0; g < group; g++)
            s[g * np + seen_n] = dot(qh + g * d, k_cache + k, dv) * scale;
        seen_n++;
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = s + g * np;
        for (int64_t c = seen_n; c < np; c++)
            sg[c] = -INFINITY;
        v8f m = splat(-INFINITY);
        for (int64_t c = 0; c < np; c += 8) {
            v8f x = load8(sg + c, 8);
            m = pick(x > m, x, m);
        }
        const v8f top = splat(hmax8(m));
        v8f sum = splat(0.0f);
        for (int64_t c = 0; c < np; c += 8) {
            v8f w = exp8(load8(sg + c, 8) - top);
            store8(sg + c, w, 8);
            sum += w;
        }
        const v8f total = splat(hsum8(sum));
        /* the weighted values, 64 of the head's floats at a time with their accumulators in registers
         * (each key's value row is read once per query head and 64 floats: from L1 after the first) */
        for (int64_t c0 = 0; c0 < dv; c0 += 8) {
            const int64_t cv = dv - c0 < 8 ? dv - c0 : 8;
            v8f acc[8];
            for (int64_t j = 0; j < 8; j++)
                acc[j] = splat(0.0f);
            for (int64_t c = 0; c < seen_n; c++) {
                if (sg[c] == 0.0f)
                    continue;   /* too far below the largest to count */
                const float *v = v_cache + at[c] + 8 * c0;
                const v8f w = splat(sg[c]);
                for (int64_t j = 0; j < cv; j++)
                    acc[j] += w * load8(v + 8 * j, 8);
            }
            for (int64_t j = 0; j < cv; j++)
                store8(o + g * d + 8 * (c0 + j), acc[j] / total, 8);
        }
    }
}

/* Items [i0, i1) of the call, item i = (query row i / kv_heads, KV head i % kv_heads), of q [T, hq, d]
 * (heads contiguous, rows q_stride floats apart) -> out [T, hq, d] (contiguous; only those items'
 * heads written). tree: NULL, or [T, tree_stride] bytes. Returns 0, or -1 when out of memory (nothing
 * written then). */
KILN_CLONES
static int attend(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                  const int32_t *tables, int64_t width, const int64_t *row_seq, const int64_t *row_pos,
                  const int64_t *row_ctx, const uint8_t *tree, int64_t tree_stride, float *out,
                  int64_t i0, int64_t i1, int64_t hq, int64_t kv_heads, int64_t d, int64_t bs, float scale) {
    const int64_t group = hq / kv_heads, dv = d / 8;
    int64_t most = 0;
    for (int64_t i = i0; i < i1; i++)
        most = row_pos[i / kv_heads] + 1 > most ? row_pos[i / kv_heads] + 1 : most;
    const int64_t cap = (most + 7) & ~(int64_t)7;
    float *s = malloc(sizeof(float) * (size_t)(group * cap + 1));
    int64_t *at = malloc(sizeof(int64_t) * (size_t)(cap + 1));
    if (!s || !at) {
        free(s);
        free(at);
        return -1;
    }
    for (int64_t i = i0; i < i1; i++) {
        const int64_t r = i / kv_heads, h = i % kv_heads;
        const int32_t *table = tables + row_seq[r] * width;
        const int64_t n = row_pos[r] + 1, np = (n + 7) & ~(int64_t)7;
        const uint8_t *seen = tree ? tree + r * tree_stride : NULL;
        const float *qh = q + r * q_stride + h * group * d;
        float *o = out + (r * hq + h * group) * d;
        /* the common head sizes with dv a constant (registers, unrolled); the same order as any */
        if (dv == 8)
            row_head(qh, k_cache, v_cache, table, n, row_ctx[r], seen, o, group, kv_heads, h, 8, bs, scale, s, np, at);
        else if (dv == 16)
            row_head(qh, k_cache, v_cache, table, n, row_ctx[r], seen, o, group, kv_heads, h, 16, bs, scale, s, np,
                     at);
        else
            row_head(qh, k_cache, v_cache, table, n, row_ctx[r], seen, o, group, kv_heads, h, dv, bs, scale, s, np,
                     at);
    }
    free(s);
    free(at);
    return 0;
}

/* The first item at or after which `part` / `parts` of the call's keys are read (an item reads its
 * row's position + 1 keys): the split between threads, contiguous runs of equal work. */
static int64_t work_bound(const int64_t *row_pos, int64_t items, int64_t kv_heads, int64_t total, int64_t part,
                          int64_t parts) {
    const int64_t goal = total * part / parts;
    int64_t done = 0, i = 0;
    for (; i < items && done < goal; i++)
        done += row_pos[i / kv_heads] + 1;
    return i;
}

/* Calls reading fewer keys than this (summed over rows and KV heads) run on one thread. Measured on
 * 2 cores (SmolLM2's 9 query / 3 KV heads of 64): the fork and join of PyTorch's (already running)
 * team costs a few microseconds; 1 row x 31 positions ran as fast either way, 4 rows x 51 in 31 us on
 * two threads against 41 on one, 16 rows x 31 in 50 against 91. */
#define PARALLEL_MIN_KEYS 256

/* All t query rows; `threads` OpenMP threads (PyTorch's team: see build.py) share the (row, KV head)
 * items out in contiguous runs of equal work, each item computed whole by one thread, so the bits
 * do not depend on the thread count. Returns the number of threads that ran, or -1 (out of memory). */
int kiln_paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                         const int32_t *tables, int64_t width, const int64_t *row_seq, const int64_t *row_pos,
                         const int64_t *row_ctx, const uint8_t *tree, int64_t tree_stride, float *out, int64_t t,
                         int64_t hq, int64_t kv_heads, int64_t d, int64_t bs, float scale, int64_t threads) {
    const int64_t items = t * kv_heads;
    int64_t total = 0;
    for (int64_t r = 0; r < t; r++)
        total += (row_pos[r] + 1) * kv_heads;
    if (threads > items)
        threads = items;
    if (threads <= 1 || total < PARALLEL_MIN_KEYS)
        return attend(q, q_stride, k_cache, v_cache, tables, width, row_seq, row_pos, row_ctx, tree, tree_stride,
                      out, 0, items, hq, kv_heads, d, bs, scale) ? -1 : 1;
    int failed = 0, ran = 1;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int64_t j = omp_get_thread_num(), nt = omp_get_num_threads();
        if (j == 0)
            ran = (int)nt;
        const int64_t i0 = work_bound(row_pos, items, kv_heads, total, j, nt);
        const int64_t i1 = work_bound(row_pos, items, kv_heads, total, j + 1, nt);
        failed |= attend(q, q_stride, k_cache, v_cache, tables, width, row_seq, row_pos, row_ctx, tree, tree_stride,
                         out, i0, i1, hq, kv_heads, d, bs, scale);
    }
    return failed ? -1 : ran;
}
