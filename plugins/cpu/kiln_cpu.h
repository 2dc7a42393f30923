/* What Kiln's CPU kernels (kernels.c, attention.c) share: 8-float vectors (GCC vector extensions:
 * AVX2 where the CPU has it, picked at load by target_clones; two SSE registers otherwise), loads and
 * stores that stop at a row's end. */
#ifndef KILN_CPU_H
#define KILN_CPU_H

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

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* m ? a : b, lane by lane (m: all ones or all zeros per lane) */
static inline v8f pick(v8i m, v8f a, v8f b) { return (v8f)(((v8i)a & m) | ((v8i)b & ~m)); }

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

#endif
