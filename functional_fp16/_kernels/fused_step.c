/* The fused optimiser steps of functional_fp16 on the CPU (SGD and Adam families).
 *
 * Every entry point works over a list of leaves (one pointer per tensor) split
 * into n_groups equal runs of consecutive leaves: leaf l belongs to group
 * l / (n_leaves / n_groups). A group is one training state (one member of a
 * vmapped ensemble; a plain update has one group), and every per-step scalar
 * is an array with one entry per group, so K members are K more entries of
 * the same call, each with its own scale, decision and counters.
 *
 *   ff_grad_stats   one read of the low-precision gradients: per group, the
 *                   largest magnitude (+inf if any element is inf or NaN) and,
 *                   when asked, the sum of squares of the unscaled gradients.
 *   ff_sgd_update   one pass that reads gradient, master and momentum once and
 *                   writes master, momentum and the working copy once; a pure
 *                   step may run before its decision, which it then makes
 *                   itself and undoes where the group skips.
 *   ff_adam_update  the same single pass for Adam/AdamW.
 *   ff_step_entry   the steps with fused_step.h's calling convention, by name
 *                   (ff_lion_step: Lion; ff_rmsprop_step: RMSProp).
 *
 * Scalars that live in tensors (the skip flags, 1/scale, the learning rates,
 * the clip factors, whether momentum has started) are read through pointers
 * here, so the Python side never reads a value back. The arguments are
 * declared once, by name, in signatures.py, which checks every call.
 *
 * Arithmetic per element, with g the gradient as stored and inv = fl32(1/s):
 *
 *   u  = fl32(g) * inv
 *   u  = (u / clip_div) * clip_mul                    (clipping only)
 *   u  = fma(m, wd, u)                                 (weight decay only)
 *   b' = b * keep + u * take                           (momentum only; keep, take
 *                                                       = mu, 1 - d once started, else 0, 1)
 *   v  = nesterov ? fma(b', mu, u) : (momentum ? b' : u)
 *   m' = fma(v, f, m)                                (f = -lr, the signed step factor)
 *   p' = round_to_nearest_even(m')
 *
 * Weight decay and Nesterov are contracted exactly as the reference chain's
 * torch.add(..., alpha=) computes them on the CPU; the step m + f * v is one
 * fused multiply-add where the reference rounds f * v first (the contraction
 * torch.optim.SGD makes too). The momentum sum is not contracted: it cancels
 * often, and a contraction there would move b' by many of its own ulps. The
 * file is compiled with -ffp-contract=off: every other product is rounded on
 * its own.
 */
#include "fused_step.h"

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

#define CHUNK 32768

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7FC0u : (uint16_t)rounded;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* Converts n elements of dtype dt to float32 (exact for every input). */
static void to_f32(const void *restrict src, float *restrict dst, int64_t n, int dt) {
    int64_t i = 0;
    if (dt == DT_F32) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    if (dt == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
    for (; i < n; ++i) dst[i] = (float)((const _Float16 *)s)[i];
}

/* Rounds n float32 values to dtype dt, to nearest with ties to even. */
static void from_f32(const float *restrict src, void *restrict dst, int64_t n, int dt) {
    int64_t i = 0;
    if (dt == DT_F32) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    if (dt == DT_BF16) {
        for (; i < n; ++i) d[i] = f32_to_bf16(src[i]);
        return;
    }
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(d + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; ++i) ((_Float16 *)d)[i] = (_Float16)src[i];
}

/* Copies n bytes to dst with non-temporal stores where dst is 64-byte aligned:
 * a pure update writes fresh memory, and a streaming store does not first
 * read the line it overwrites (no read-for-ownership). */
static void stream_bytes(void *restrict dst, const void *restrict src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX__)
    /* the bytes up to dst's first aligned line are stored as usual (a partial line) */
    const int64_t head = (int64_t)((64u - ((uintptr_t)dst & 63u)) & 63u);
    if (head && n >= head + 64) {
        memcpy(dst, src, (size_t)head);
        i = head;
    }
#endif
#if defined(__AVX512F__)
    if ((((uintptr_t)dst + (uintptr_t)i) & 63u) == 0)
        for (; i + 64 <= n; i += 64)
            _mm512_stream_si512((void *)((char *)dst + i),
                                _mm512_loadu_si512((const void *)((const char *)src + i)));
#elif defined(__AVX__)
    if ((((uintptr_t)dst + (uintptr_t)i) & 31u) == 0)
        for (; i + 32 <= n; i += 32)
            _mm256_stream_si256((__m256i *)((char *)dst + i),
                                _mm256_loadu_si256((const __m256i *)((const char *)src + i)));
#endif
    if (i < n) memcpy((char *)dst + i, (const char *)src + i, (size_t)(n - i));
}

static void stream_fence(void) {
#if defined(__AVX__) || defined(__SSE2__)
    _mm_sfence();
#endif
}

static int dt_size(int dt) { return dt == DT_F32 ? 4 : 2; }

static inline float bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

/* ------------------------------------------------------------------------ */
/* The split master (master_split.py): FP16 params p and int16 residuals q.  */
/* ------------------------------------------------------------------------ */

/* u(p) = sign(p) 2^(max(e, 1) - 40) for the FP16 pattern h with exponent field e, as
 * float32 bits (biased exponent max(e, 1) + 87); its inverse has biased exponent
 * 167 - max(e, 1). */
static inline uint32_t unit_sign(uint16_t h) { return (uint32_t)(h & 0x8000u) << 16; }
static inline uint32_t unit_exponent(uint16_t h) {
    const uint32_t e = (h >> 10) & 31u;
    return e < 1u ? 1u : e;
}

/* FP16 bits to float32, exactly, in integer and float32 operations a loop vectorises: the
 * magnitude's bits moved to float32's places and scaled by 2^112 (bias 15 to 127; exact
 * for subnormals too), the exponent set to all ones for inf and NaN (a NaN made quiet, as
 * vcvtph2ps makes it). With half_bits, equal to vcvtph2ps and vcvtps2ph on every FP16 and
 * every float32 pattern (a harness that includes this file, run when they were written);
 * the suite runs both on the remainders of the split-master tests' leaves. */
static inline float half_value(uint16_t h) {
    const uint32_t a = (uint32_t)(h & 0x7FFFu);
    const uint32_t special = (a >= 0x7C00u ? 0x7F800000u : 0u) | (a > 0x7C00u ? 0x400000u : 0u);
    const uint32_t v = f32_bits(bits_f32(a << 13) * 0x1p112f) | special;
    return bits_f32(v | ((uint32_t)(h & 0x8000u) << 16));
}

/* float32 to FP16 bits, to nearest with ties to even (as vcvtps2ph): at or above 65536
 * inf (NaN: quiet, its top mantissa bits kept); below 2^-14 the subnormal grid by one
 * float32 addition of 1/2 (which rounds to multiples of 2^-24); else rebias and round. */
static inline uint16_t half_bits(float x) {
    const uint32_t u = f32_bits(x), a = u & 0x7FFFFFFFu;
    const uint32_t big = a > 0x7F800000u ? 0x7E00u | ((a >> 13) & 0x3FFu) : 0x7C00u;
    const uint32_t sub = f32_bits(bits_f32(a) + 0.5f) - 0x3F000000u;
    const uint32_t normal = (a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13;
    const uint32_t h = a >= 0x47800000u ? big : (a < 0x38800000u ? sub : normal);
    return (uint16_t)(h | ((u >> 16) & 0x8000u));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* The split master 16 lanes at a time, in registers. The element loops of a split
 * master (sgd_split_block, adam_split_block, lion_split_block) load p and q, join,
 * step, split and store in one pass; a block's last lanes past n are masked off
 * (loaded as zeros, never stored), so no block needs a scalar remainder. Elsewhere a
 * split block goes through float32 buffers (join_master, the float32 block loop,
 * store_split): the same operations on the same values. */
#define FF_SPLIT_LANES 1

/* u(p) of 16 params from their float32 values pf, as the bits of sign(p) 2^(E + offset)
 * with E = max(exponent of p, -14) (offset -25: u; 25 - 2E via negate: 1/u): p's float32
 * exponent field, raised to -14's where p is subnormal or zero. */
static inline __m512i exponents16(__m512 pf) {
    return _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(pf), _mm512_set1_epi32(0x7F800000)),
                            _mm512_set1_epi32(113 << 23));
}
static inline __m512i signs16(__m512 pf) {
    return _mm512_and_si512(_mm512_castps_si512(pf), _mm512_set1_epi32((int)0x80000000u));
}

/* The float32 masters p + q u(p) of 16 params p and residuals q (as loaded): one fused
 * multiply-add, exact (q u and the sum are both representable). */
static inline __m512 join_lanes(__m256i p, __m256i q) {
    const __m512 pf = _mm512_cvtph_ps(p);
    const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(q));
    const __m512i u = _mm512_or_si512( /* 2^(E - 25): E's field less 25 */
        _mm512_sub_epi32(exponents16(pf), _mm512_set1_epi32(25 << 23)), signs16(pf));
    return _mm512_fmadd_ps(qf, _mm512_castsi512_ps(u), pf);
}

/* split of 16 float32 masters x: the params returned, the residuals in *q. Only where
 * fl16(x) has a zero exponent field (|x| < 2^-14, where the grid can matter: it does
 * below 2^-16 only) is x put on the grid of 2^-39 and rounded again, a branch rarely
 * taken. Where p is inf or NaN, (x - p) / u is inf or NaN, which vcvttps2dq makes
 * 0x80000000 and vpmovdw (truncating) 0: the residual 0, as split() defines it. */
static inline __m256i split_lanes(__m512 x, __m256i *q) {
    __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 t = x;
    const __mmask16 small = _mm256_testn_epi16_mask(h, _mm256_set1_epi16(0x7C00));
    if (small) {
        t = _mm512_mask_mul_ps(x, small,
                               _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(0x1p39f)),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                               _mm512_set1_ps(0x1p-39f));
        h = _mm512_cvtps_ph(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    const __m512 pf = _mm512_cvtph_ps(h);
    const __m512i inv_u = _mm512_or_si512( /* 2^(25 - E): 279 less E's biased field */
        _mm512_sub_epi32(_mm512_set1_epi32(279 << 23), exponents16(pf)), signs16(pf));
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, pf), _mm512_castsi512_ps(inv_u));
    *q = _mm512_cvtepi32_epi16(_mm512_cvttps_epi32(r));
    return h;
}
#endif

/* The float32 master p + q u(p) of n elements (exact: it is the master split() was given,
 * put on the grid below 2^-14). */
static void join_master(const uint16_t *restrict p, const int16_t *restrict q,
                        float *restrict out, int64_t n) {
    int64_t i = 0;
#if defined(FF_SPLIT_LANES)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, join_lanes(_mm256_loadu_si256((const __m256i *)(p + i)),
                                             _mm256_loadu_si256((const __m256i *)(q + i))));
#endif
    for (; i < n; ++i) {
        const float u = bits_f32(((unit_exponent(p[i]) + 87u) << 23) | unit_sign(p[i]));
        out[i] = half_value(p[i]) + (float)q[i] * u;
    }
}

/* split(m) of n float32 masters into FP16 params p and int16 residuals q: below 2^-14
 * m is put on the grid of 2^-39 (to nearest, ties to even), p = fl16 of that, and
 * q = (that - p) / u(p), exact; 0 where p is inf or NaN. */
static void split_master(const float *restrict m, uint16_t *restrict p, int16_t *restrict q,
                         int64_t n) {
    int64_t i = 0;
#if defined(FF_SPLIT_LANES)
    for (; i + 16 <= n; i += 16) {
        __m256i r;
        _mm256_storeu_si256((__m256i *)(p + i), split_lanes(_mm512_loadu_ps(m + i), &r));
        _mm256_storeu_si256((__m256i *)(q + i), r);
    }
#endif
    for (; i < n; ++i) {
        const float x = m[i];
        const float t = fabsf(x) < 0x1p-14f ? nearbyintf(x * 0x1p39f) * 0x1p-39f : x;
        const uint16_t h = half_bits(t);
        const float inv_u = bits_f32(((167u - unit_exponent(h)) << 23) | unit_sign(h));
        const float r = (t - half_value(h)) * inv_u;
        p[i] = h;
        q[i] = (int16_t)(int32_t)(((h >> 10) & 31u) == 31u ? 0.0f : r);
    }
}

/* The params and residuals split from n new masters m, written to po and qo: streamed
 * into a pure step's fresh memory, stored as usual over a donated step's inputs (lines
 * the step's loads just brought into cache). pq: room for 2n halves. */
static void store_split(const float *m, void *po, void *qo, uint16_t *pq, int stream,
                        int64_t n) {
    split_master(m, pq, (int16_t *)(pq + n), n);
    if (stream) {
        stream_bytes(po, pq, n * 2);
        stream_bytes(qo, pq + n, n * 2);
    } else {
        memcpy(po, pq, (size_t)n * 2);
        memcpy(qo, pq + n, (size_t)n * 2);
    }
}

#if defined(FF_SPLIT_LANES)
/* Lanes i .. i + 15 of a block, k the ones in range: every helper takes k, and a loop
 * over a block's whole vectors passes the constant 0xFFFF, which folds their masks
 * away (masked loads and stores cost more than plain ones). */
static inline __mmask16 lanes_left(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFFu : (__mmask16)((1u << left) - 1u);
}

/* The loops of a split master ask for their inputs this many elements ahead: with one
 * thread the step is close to bound by its operations, and a core that does not wait for
 * the next lines of its four or five streams keeps up (about 5 % of a donated step). */
#define SPLIT_AHEAD 256

static inline void ahead(const void *x, int64_t i, int size) {
    _mm_prefetch((const char *)x + (i + SPLIT_AHEAD) * size, _MM_HINT_T0);
}

static inline __m256i halves_at(const void *x, int64_t i, __mmask16 k) {
    const uint16_t *s = (const uint16_t *)x + i;
    return k == 0xFFFFu ? _mm256_loadu_si256((const __m256i *)(const void *)s)
                        : _mm256_maskz_loadu_epi16(k, s);
}

static inline __m512 load_lanes(const float *x, int64_t i, __mmask16 k) {
    return k == 0xFFFFu ? _mm512_loadu_ps(x + i) : _mm512_maskz_loadu_ps(k, x + i);
}

/* 16 gradients of dtype gd from element i of g, as float32 (exact, as to_f32). */
static inline __m512 grad_lanes(const char *g, int gd, int64_t i, __mmask16 k) {
    if (gd == DT_F32) return load_lanes((const float *)(const void *)g, i, k);
    const __m256i h = halves_at(g, i, k);
    if (gd == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* The master of 16 elements from i of the params p and residuals q. */
static inline __m512 master_lanes(const uint16_t *p, const int16_t *q, int64_t i, __mmask16 k) {
    return join_lanes(halves_at(p, i, k), halves_at(q, i, k));
}

/* Stores 16 float32 lanes, streamed (stream: x + i is 64-byte aligned and fresh). */
static inline void store_lanes(float *x, int64_t i, __m512 v, __mmask16 k, int stream) {
    if (k != 0xFFFFu)
        _mm512_mask_storeu_ps(x + i, k, v);
    else if (stream)
        _mm512_stream_ps(x + i, v);
    else
        _mm512_storeu_ps(x + i, v);
}

/* The params and residuals of 16 new masters m, to po and qo from element i (stream:
 * both 32-byte aligned and fresh). */
static inline void store_split_lanes(uint16_t *po, int16_t *qo, int64_t i, __m512 m,
                                     __mmask16 k, int stream) {
    __m256i q;
    const __m256i p = split_lanes(m, &q);
    if (k != 0xFFFFu) {
        _mm256_mask_storeu_epi16(po + i, k, p);
        _mm256_mask_storeu_epi16(qo + i, k, q);
    } else if (stream) {
        _mm256_stream_si256((__m256i *)(void *)(po + i), p);
        _mm256_stream_si256((__m256i *)(void *)(qo + i), q);
    } else {
        _mm256_storeu_si256((__m256i *)(void *)(po + i), p);
        _mm256_storeu_si256((__m256i *)(void *)(qo + i), q);
    }
}

/* Whether a pure step's outputs take streaming stores: every one fresh and aligned. */
static inline int streams(int fresh, const void *f32_out, const void *po, const void *qo) {
    return fresh && ((uintptr_t)f32_out & 63u) == 0 && ((uintptr_t)po & 31u) == 0 &&
           ((uintptr_t)qo & 31u) == 0;
}
#endif

typedef struct {
    int32_t leaf;
    int64_t start, len;
} Chunk;

/* Splits every leaf into pieces of at most CHUNK elements. */
static Chunk *make_chunks(int64_t n_leaves, const int64_t *numel, int64_t *n_chunks) {
    int64_t total = 0;
    for (int64_t l = 0; l < n_leaves; ++l) total += (numel[l] + CHUNK - 1) / CHUNK;
    Chunk *c = (Chunk *)malloc((size_t)(total ? total : 1) * sizeof(Chunk));
    int64_t k = 0;
    for (int64_t l = 0; l < n_leaves; ++l)
        for (int64_t s = 0; s < numel[l]; s += CHUNK) {
            c[k].leaf = (int32_t)l;
            c[k].start = s;
            c[k].len = numel[l] - s < CHUNK ? numel[l] - s : CHUNK;
            ++k;
        }
    *n_chunks = k;
    return c;
}

/* ------------------------------------------------------------------------ */
/* Gradient statistics.                                                      */
/* ------------------------------------------------------------------------ */

#define BLOCK 512

/* Largest magnitude as a bit pattern: for IEEE formats |x| orders like the
 * integer (bits & ~sign), and inf and NaN come above every finite value.
 * One loop, instantiated for 32-bit and 16-bit elements. */
#define PEAK_BITS(NAME, T, NO_SIGN)                     \
    static T NAME(const T *u, int64_t n) {             \
        T mx = 0;                                      \
        _Pragma("omp simd reduction(max : mx)")        \
        for (int64_t i = 0; i < n; ++i) {              \
            T a = u[i] & NO_SIGN;                      \
            mx = a > mx ? a : mx;                      \
        }                                              \
        return mx;                                     \
    }
PEAK_BITS(peak_bits32, uint32_t, 0x7FFFFFFFu)
PEAK_BITS(peak_bits16, uint16_t, 0x7FFFu)
#undef PEAK_BITS

static uint32_t peak_bits(const void *x, int64_t n, int dt) {
    if (dt == DT_F32) return peak_bits32((const uint32_t *)x, n);
    return peak_bits16((const uint16_t *)x, n);
}

/* The float32 value of a magnitude bit pattern; +inf for inf and NaN. */
static float peak_value(uint32_t bits, int dt) {
    float f;
    if (dt == DT_F32) {
        if (bits >= 0x7F800000u) return INFINITY;
        memcpy(&f, &bits, 4);
        return f;
    }
    if (dt == DT_BF16) return bits >= 0x7F80u ? INFINITY : bf16_to_f32((uint16_t)bits);
    if (bits >= 0x7C00u) return INFINITY;
    uint16_t h = (uint16_t)bits;
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

/* Sum of w^2 over w = fl32(x * inv), in double: each square is exact there, so
 * only the additions round (relative error about n * 2^-53). */
static double sum_squares(const void *x, int64_t n, int dt, float inv) {
    float buf[BLOCK];
    double total = 0.0;
    for (int64_t s = 0; s < n; s += BLOCK) {
        const int64_t len = n - s < BLOCK ? n - s : BLOCK;
        to_f32((const char *)x + s * dt_size(dt), buf, len, dt);
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < len; ++i) {
            double w = (double)(buf[i] * inv);
            total += w * w;
        }
    }
    return total;
}

/* Per leaf l: peak_out[l] = largest |g_l| as float32 (+inf if any element is
 * inf or NaN, 0 for an empty leaf); per group k: sq_out[k] = sum of
 * fl32(g * inv[k])^2 (only if want_sq). One read of the gradients. inv NULL:
 * a unit scale. */
void ff_grad_stats(int64_t n_leaves, int64_t n_groups, void *const *grads, const int64_t *numel,
                   const int32_t *gdt, const float *inv, int32_t want_sq, int32_t threads,
                   float *peak_out, double *sq_out) {
    int64_t n_chunks;
    Chunk *chunks = make_chunks(n_leaves, numel, &n_chunks);
    const int64_t per_group = n_leaves / n_groups;
    const int nt = threads > 0 ? threads : 1;
    /* One row of partial results per thread, on the heap (an OpenMP array
     * reduction would put n_leaves values per thread on the stack). */
    float *peak = (float *)calloc((size_t)(nt * n_leaves), sizeof(float));
    double *sq = (double *)calloc((size_t)(nt * n_groups), sizeof(double));
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t k = 0; k < n_chunks; ++k) {
        const Chunk *c = &chunks[k];
        const int64_t grp = c->leaf / per_group;
        const int64_t t = (int64_t)omp_get_thread_num();
        const int dt = gdt[c->leaf];
        const char *x = (const char *)grads[c->leaf] + c->start * dt_size(dt);
        float v = peak_value(peak_bits(x, c->len, dt), dt);
        float *row = &peak[t * n_leaves + c->leaf];
        *row = v > *row ? v : *row;
        if (want_sq) sq[t * n_groups + grp] += sum_squares(x, c->len, dt, inv ? inv[grp] : 1.0f);
    }
    free(chunks);
    for (int64_t l = 0; l < n_leaves; ++l) {
        float top = 0.0f;
        for (int t = 0; t < nt; ++t) top = peak[t * n_leaves + l] > top ? peak[t * n_leaves + l] : top;
        peak_out[l] = top;
    }
    if (want_sq) {
        for (int64_t k = 0; k < n_groups; ++k) {
            double total = 0.0;
            for (int t = 0; t < nt; ++t) total += sq[t * n_groups + k]; /* in thread order */
            sq_out[k] = total;
        }
    }
    free(peak);
    free(sq);
}

/* ------------------------------------------------------------------------ */
/* The update.                                                               */
/* ------------------------------------------------------------------------ */

typedef struct {
    float inv, clip_div, clip_mul, wd, mu, keep, take, factor;
    int clip, decay, momentum, nesterov;
} Hyper;

/* One block of float32 values, every flag a compile-time constant after inlining. */
static inline __attribute__((always_inline)) void sgd_body(
    const Hyper *h, const float *g, const float *m, const float *b,
    float *m_out, float *b_out, float *p_out, int64_t n,
    const int CLIP, const int DECAY, const int MOMENTUM, const int NESTEROV) {
    const float inv = h->inv, cd = h->clip_div, cm = h->clip_mul, wd = h->wd, mu = h->mu,
                keep = h->keep, take = h->take, factor = h->factor;
    for (int64_t i = 0; i < n; ++i) {
        float u = g[i] * inv;
        if (CLIP) u = (u / cd) * cm;
        float mi = m[i];
        if (DECAY) u = fmaf(mi, wd, u);
        float v = u;
        if (MOMENTUM) {
            float nb = b[i] * keep + u * take;
            b_out[i] = nb;
            v = NESTEROV ? fmaf(nb, mu, u) : nb;
        }
        float nm = fmaf(v, factor, mi);
        m_out[i] = nm;
        p_out[i] = nm;
    }
}

/* sgd_body with every pointer restrict: a pure step, each output a buffer of its own. */
static inline __attribute__((always_inline)) void sgd_block(
    const Hyper *h, const float *restrict g, const float *restrict m, const float *restrict b,
    float *restrict m_out, float *restrict b_out, float *restrict p_out, int64_t n,
    const int CLIP, const int DECAY, const int MOMENTUM, const int NESTEROV) {
    sgd_body(h, g, m, b, m_out, b_out, p_out, n, CLIP, DECAY, MOMENTUM, NESTEROV);
}

/* sgd_body stepping its state in place (a donated step): each state one restrict
 * pointer, read and written (every element read before it is written); the working
 * copy (p_out) a buffer of its own. */
static inline __attribute__((always_inline)) void sgd_block_in_place(
    const Hyper *h, const float *restrict g, float *restrict m, float *restrict b,
    float *restrict p_out, int64_t n, const int CLIP, const int DECAY, const int MOMENTUM,
    const int NESTEROV) {
    sgd_body(h, g, m, b, m, b, p_out, n, CLIP, DECAY, MOMENTUM, NESTEROV);
}

/* Every combination of sgd_block's flags (clip, decay, momentum, Nesterov) that a call
 * can make gets a loop of its own. */
#define SGD_FLAGS(X) \
    X(0, 0, 1, 0) X(0, 0, 0, 0) X(1, 0, 1, 0) X(0, 1, 1, 0) X(1, 1, 1, 0) X(0, 0, 1, 1) \
    X(0, 1, 1, 1) X(1, 0, 1, 1) X(1, 1, 1, 1) X(1, 0, 0, 0) X(0, 1, 0, 0) X(1, 1, 0, 0)

/* In place where mo == m: a donated step, every state in place (the outputs are the
 * inputs); else every output a buffer of its own. po is never a state. */
static void sgd_dispatch(const Hyper *h, const float *g, const float *m, const float *b,
                         float *mo, float *bo, float *po, int64_t n) {
#define SGD_CASE(C, D, M, N)                                                       \
    if (h->clip == C && h->decay == D && h->momentum == M && h->nesterov == N) { \
        if (mo == m) sgd_block_in_place(h, g, mo, bo, po, n, C, D, M, N);        \
        else sgd_block(h, g, m, b, mo, bo, po, n, C, D, M, N);                   \
        return;                                                                  \
    }
    SGD_FLAGS(SGD_CASE)
#undef SGD_CASE
}


#if defined(FF_SPLIT_LANES)
/* sgd_block's step on a split master in registers: lanes i .. i + 15 (k: those in range)
 * of the master joined from p and q, stepped with sgd_block's operations in its order,
 * split into po and qo. */
typedef struct {
    __m512 inv, cd, cm, wd, mu, keep, take, factor;
} SgdLanes;

static inline __attribute__((always_inline)) void sgd_lanes(
    const SgdLanes c, const char *g, int gd, const uint16_t *p, const int16_t *q,
    const float *b, uint16_t *po, int16_t *qo, float *bo, int64_t i, __mmask16 k, int stream,
    const int CLIP, const int DECAY, const int MOMENTUM, const int NESTEROV) {
    __m512 u = _mm512_mul_ps(grad_lanes(g, gd, i, k), c.inv);
    if (CLIP) u = _mm512_mul_ps(_mm512_div_ps(u, c.cd), c.cm);
    const __m512 mi = master_lanes(p, q, i, k);
    if (DECAY) u = _mm512_fmadd_ps(mi, c.wd, u);
    __m512 v = u;
    if (MOMENTUM) {
        const __m512 nb =
            _mm512_add_ps(_mm512_mul_ps(load_lanes(b, i, k), c.keep), _mm512_mul_ps(u, c.take));
        store_lanes(bo, i, nb, k, stream);
        v = NESTEROV ? _mm512_fmadd_ps(nb, c.mu, u) : nb;
    }
    store_split_lanes(po, qo, i, _mm512_fmadd_ps(v, c.factor, mi), k, stream);
}

static inline __attribute__((always_inline)) void sgd_split_block(
    const Hyper *h, const char *g, int gd, const uint16_t *p, const int16_t *q,
    const float *b, uint16_t *po, int16_t *qo, float *bo, int64_t n, int stream,
    const int CLIP, const int DECAY, const int MOMENTUM, const int NESTEROV) {
    const SgdLanes c = {_mm512_set1_ps(h->inv),  _mm512_set1_ps(h->clip_div),
                        _mm512_set1_ps(h->clip_mul), _mm512_set1_ps(h->wd),
                        _mm512_set1_ps(h->mu),   _mm512_set1_ps(h->keep),
                        _mm512_set1_ps(h->take), _mm512_set1_ps(h->factor)};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        ahead(g, i, dt_size(gd));
        ahead(p, i, 2);
        ahead(q, i, 2);
        if (MOMENTUM) ahead(b, i, 4);
        sgd_lanes(c, g, gd, p, q, b, po, qo, bo, i, 0xFFFFu, stream, CLIP, DECAY, MOMENTUM,
                  NESTEROV);
    }
    if (i < n)
        sgd_lanes(c, g, gd, p, q, b, po, qo, bo, i, lanes_left(n - i), stream, CLIP, DECAY,
                  MOMENTUM, NESTEROV);
}
#endif

/* One block of n elements of ff_sgd_update on a split master: g (dtype gd), the params
 * p and residuals q, the momentum b (NULL without momentum), to po, qo and bo (the
 * inputs themselves when donated; fresh: a pure step's new memory). Every read of the
 * block comes before its writes. */
static void sgd_split(const Hyper *h, const char *g, int gd, const uint16_t *p,
                      const int16_t *q, const float *b, uint16_t *po, int16_t *qo, float *bo,
                      int64_t n, int fresh) {
#if defined(FF_SPLIT_LANES)
    const int stream = streams(fresh, bo ? (const void *)bo : (const void *)po, po, qo);
#define SGD_CASE(C, D, M, N)                                                       \
    if (h->clip == C && h->decay == D && h->momentum == M && h->nesterov == N) { \
        sgd_split_block(h, g, gd, p, q, b, po, qo, bo, n, stream, C, D, M, N);   \
        return;                                                                  \
    }
    SGD_FLAGS(SGD_CASE)
#undef SGD_CASE
#else
    float gbuf[BLOCK], wbuf[BLOCK], mbuf[BLOCK], bbuf[BLOCK], pbuf[BLOCK];
    uint16_t pq[2 * BLOCK];
    to_f32(g, gbuf, n, gd);
    join_master(p, q, wbuf, n);
    sgd_dispatch(h, gbuf, wbuf, b, mbuf, bbuf, pbuf, n);
    if (h->momentum && fresh) stream_bytes(bo, bbuf, n * 4);
    if (h->momentum && !fresh) memcpy(bo, bbuf, (size_t)n * 4);
    store_split(mbuf, po, qo, pq, fresh, n);
#endif
}

/* Undoes a speculative pure step of ff_sgd_update in every group
 * whose apply[k] is false: copies the old master, momentum (b may be NULL) and
 * working copy over the outputs, bit for bit. Applied groups are not touched. */
static void keep_unless(int64_t n_leaves, int64_t n_groups, float *const *m, float *const *b,
                    void *const *p, float *const *mo, float *const *bo, void *const *po,
                        const int64_t *numel, const int32_t *pdt, const uint8_t *apply,
                        int ms, int32_t threads) {
    int any_skip = 0;
    for (int64_t k = 0; k < n_groups; ++k) any_skip |= apply[k] == 0;
    if (!any_skip) return;
    const int64_t per_group = n_leaves / n_groups;
    int64_t n_chunks;
    Chunk *chunks = make_chunks(n_leaves, numel, &n_chunks);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t k = 0; k < n_chunks; ++k) {
        const Chunk *c = &chunks[k];
        const int l = c->leaf, ps = dt_size(pdt[l]);
        if (apply[l / per_group]) continue;
        const int64_t s = c->start, n = c->len;
        memcpy((char *)mo[l] + s * ms, (const char *)m[l] + s * ms, (size_t)n * ms);
        if (b) memcpy(bo[l] + s, b[l] + s, (size_t)n * 4);
        if (po[l] != (void *)mo[l])
            memcpy((char *)po[l] + s * ps, (const char *)p[l] + s * ps, (size_t)(n * ps));
    }
    free(chunks);
}

/* Pointers per leaf: g (grad, dtype gdt), m (master, f32), b (momentum, f32;
 * unused without momentum), p (old working copy, dtype pdt; read only for a
 * skipped pure step), and the outputs mo, bo, po (equal to m, b, p when
 * donating; po equal to mo, and p to m, for a leaf whose working copy is its
 * master). Per-group scalars read through pointers: inv (NULL: 1), clip_div
 * and clip_mul (NULL: no clipping), lr; apply and started are bools (started
 * NULL: no momentum); take_started is fl32(1 - dampening), rounded once from
 * the exact difference. Momentum is on iff b is given (the momentum value
 * may round to 0 in float32); Nesterov only with momentum.
 *
 * apply NULL: a speculative pure step (fresh outputs), applied whatever the
 * gradients while it finds each leaf's largest gradient magnitude; then
 * leaf_finite_out[l] = isfinite(fl32(peak_l * inv[k])) for leaf l of group k,
 * decided_out[k] = the AND of its leaves' flags && require[k] (require NULL:
 * true), the decision grads_finite makes, and the groups that skip get their
 * old state copied back (keep_unless). apply given: decided_out and
 * leaf_finite_out are NULL. split: m and mo hold int16 residuals of the FP16 working
 * copies p and po (master_split.py): the master is joined from p and m and split into po
 * and mo, in the same pass. */
void ff_sgd_update(int64_t n_leaves, int64_t n_groups, void *const *g, float *const *m,
                   float *const *b, void *const *p, float *const *mo, float *const *bo,
                   void *const *po, const int64_t *numel, const int32_t *gdt, const int32_t *pdt,
                   const float *inv, const float *clip_div, const float *clip_mul,
                   const float *lr, const uint8_t *apply, const uint8_t *require,
                   const uint8_t *started, float weight_decay, float momentum,
                   float take_started, int32_t nesterov, int32_t split, int32_t threads,
                   uint8_t *decided_out, uint8_t *leaf_finite_out) {
    const int want_peak = apply == NULL;
    const int ms = split ? 2 : 4; /* bytes per element of the master (or residual) */
    const int64_t per_group = n_leaves / n_groups;
    Hyper *hs = (Hyper *)malloc((size_t)n_groups * sizeof(Hyper));
    uint8_t *go = (uint8_t *)malloc((size_t)n_groups);
    for (int64_t k = 0; k < n_groups; ++k) {
        Hyper *h = &hs[k];
        go[k] = apply ? apply[k] != 0 : 1;
        h->inv = inv ? inv[k] : 1.0f;
        h->clip = clip_div != NULL;
        h->clip_div = h->clip ? clip_div[k] : 1.0f;
        h->clip_mul = h->clip ? clip_mul[k] : 1.0f;
        h->decay = weight_decay != 0.0f;
        h->wd = weight_decay;
        h->momentum = b != NULL; /* the momentum buffers are given iff momentum is on */
        h->mu = momentum;
        const int has_started = started ? started[k] != 0 : 0;
        /* the first buffer is the gradient itself: b * 0 + u * 1 */
        h->keep = has_started ? momentum : 0.0f;
        h->take = has_started ? take_started : 1.0f;
        h->nesterov = nesterov != 0 && h->momentum; /* Nesterov needs momentum */
        h->factor = lr[k];
    }
    const int nt = threads > 0 ? threads : 1;
    /* a row of n_leaves per thread */
    float *peak = want_peak ? (float *)calloc((size_t)(nt * n_leaves), sizeof(float)) : NULL;

    int64_t n_chunks;
    Chunk *chunks = make_chunks(n_leaves, numel, &n_chunks);
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t k = 0; k < n_chunks; ++k) {
        const Chunk *c = &chunks[k];
        const int l = c->leaf;
        const int64_t grp = l / per_group;
        const Hyper *h = &hs[grp];
        const int gd = gdt[l], pd = pdt[l], gs = dt_size(gd), ps = dt_size(pd);
        const int p_is_master = po[l] == (void *)mo[l];
        if (want_peak) {
            float v = peak_value(peak_bits((const char *)g[l] + c->start * gs, c->len, gd), gd);
            float *row = &peak[(int64_t)omp_get_thread_num() * n_leaves + l];
            *row = v > *row ? v : *row;
        }
        for (int64_t s = c->start; s < c->start + c->len; s += BLOCK) {
            const int64_t end = c->start + c->len, n = end - s < BLOCK ? end - s : BLOCK;
            float *mo_s = mo[l] + s;
            float *bo_s = h->momentum ? bo[l] + s : NULL;
            char *po_s = (char *)po[l] + s * ps;
            if (!go[grp]) {
                /* A skipped step: the new state is the old one, bit for bit. */
                if (mo[l] != m[l])
                    memcpy((char *)mo[l] + s * ms, (const char *)m[l] + s * ms, (size_t)n * ms);
                if (h->momentum && bo[l] != b[l]) memcpy(bo_s, b[l] + s, (size_t)n * 4);
                if (po[l] != p[l] && !p_is_master)
                    memcpy(po_s, (const char *)p[l] + s * ps, (size_t)(n * ps));
                continue;
            }
            const float *b_s = h->momentum ? b[l] + s : NULL;
            if (split) {
                sgd_split(h, (const char *)g[l] + s * gs, gd, (const uint16_t *)p[l] + s,
                          (const int16_t *)(const void *)m[l] + s, b_s, (uint16_t *)(void *)po_s,
                          (int16_t *)(void *)mo[l] + s, bo_s, n, mo[l] != m[l]);
                continue;
            }
            float gbuf[BLOCK], pbuf[BLOCK];
            to_f32((const char *)g[l] + s * gs, gbuf, n, gd);
            float hbuf[BLOCK]; /* the working copy in its dtype (room for float32) */
            if (mo[l] == m[l] && (!h->momentum || bo[l] == b[l])) {
                /* donated: master and momentum stepped in place, on lines the loads
                 * just brought into cache */
                sgd_dispatch(h, gbuf, mo_s, bo_s, mo_s, bo_s, pbuf, n);
            } else {
                float mbuf[BLOCK], bbuf[BLOCK];
                sgd_dispatch(h, gbuf, m[l] + s, b_s, mbuf, bbuf, pbuf, n);
                stream_bytes(mo_s, mbuf, n * 4);
                if (h->momentum) stream_bytes(bo_s, bbuf, n * 4);
            }
            if (!p_is_master) { /* the working copy, never read, streamed */
                from_f32(pbuf, hbuf, n, pd);
                stream_bytes(po_s, hbuf, n * ps);
            }
        }
        stream_fence(); /* each thread orders its own streaming stores */
    }
    free(chunks);
    if (want_peak) {
        for (int64_t k = 0; k < n_groups; ++k) decided_out[k] = require == NULL || require[k] != 0;
        for (int64_t l = 0; l < n_leaves; ++l) {
            const int64_t k = l / per_group;
            float top = 0.0f;
            for (int t = 0; t < nt; ++t) top = peak[t * n_leaves + l] > top ? peak[t * n_leaves + l] : top;
            const float scaled = inv ? top * inv[k] : top; /* fl32, as torch multiplies */
            leaf_finite_out[l] = isfinite(scaled) != 0;
            /* the AND over the group's leaves: isfinite(fl32(max peak * inv)), rounding
             * being monotonic */
            decided_out[k] = decided_out[k] && leaf_finite_out[l];
        }
        keep_unless(n_leaves, n_groups, m, b, p, mo, bo, po, numel, pdt, decided_out, ms, nt);
    }
    free(peak);
    free(go);
    free(hs);
}

/* ------------------------------------------------------------------------ */
/* The Adam/AdamW update.                                                    */
/* ------------------------------------------------------------------------ */

/* Per element, as the reference chain scale_by_adam -> [decay] -> learning rate
 * computes it (torch.optim.Adam's operations), with u the unscaled gradient:
 *
 *   u  = fma(m, l2, u)                                  (Adam's L2 decay only)
 *   a' = fma(w, u - a, a)  if w < 0.5, else fma(w - 1, u - a, u)
 *                                                       (torch.lerp(a, u, w), w = 1 - b1)
 *   v' = fma(c2 * u, u, v * b2)                         (addcmul(v * b2, u, u, c2), c2 = 1 - b2)
 *   s  = (a' / (sqrt(v') / sqrt_c2 + eps)) * inv_c1     (the bias corrections, float32)
 *   s  = fma(m, wd, s)                                  (AdamW's decoupled decay only)
 *   m' = fma(s, f, m)                                   (f = -lr: the allowed contraction)
 *
 * The two moment updates contract exactly where torch's CPU kernels for lerp
 * and addcmul do, so the moments are bitwise the reference's.
 */
typedef struct {
    float inv, clip_div, clip_mul, l2, w, w_minus_1, b2, c2, sqrt_c2, inv_c1, eps, wd, factor;
    int clip, has_l2, decoupled, small_w;
} AdamHyper;

static inline __attribute__((always_inline)) void adam_body(
    const AdamHyper *h, const float *g, const float *m,
    const float *a, const float *v, float *m_out,
    float *a_out, float *v_out, float *p_out, int64_t n,
    const int CLIP, const int L2, const int DECOUPLED) {
    const float inv = h->inv, cd = h->clip_div, cm = h->clip_mul, l2 = h->l2, b2 = h->b2,
                c2 = h->c2, sqrt_c2 = h->sqrt_c2, inv_c1 = h->inv_c1, eps = h->eps, wd = h->wd,
                factor = h->factor;
    const float coef = h->small_w ? h->w : h->w_minus_1;
    const int small_w = h->small_w;
    for (int64_t i = 0; i < n; ++i) {
        float u = g[i] * inv;
        if (CLIP) u = (u / cd) * cm;
        const float mi = m[i], ai = a[i];
        if (L2) u = fmaf(mi, l2, u);
        const float na = fmaf(coef, u - ai, small_w ? ai : u);
        const float nv = fmaf(c2 * u, u, v[i] * b2);
        a_out[i] = na;
        v_out[i] = nv;
        float s = (na / (sqrtf(nv) / sqrt_c2 + eps)) * inv_c1;
        if (DECOUPLED) s = fmaf(mi, wd, s);
        const float nm = fmaf(s, factor, mi);
        m_out[i] = nm;
        p_out[i] = nm;
    }
}

/* adam_body with every pointer restrict: a pure step, each output a buffer of its own. */
static inline __attribute__((always_inline)) void adam_block(
    const AdamHyper *h, const float *restrict g, const float *restrict m,
    const float *restrict a, const float *restrict v, float *restrict m_out,
    float *restrict a_out, float *restrict v_out, float *restrict p_out, int64_t n,
    const int CLIP, const int L2, const int DECOUPLED) {
    adam_body(h, g, m, a, v, m_out, a_out, v_out, p_out, n, CLIP, L2, DECOUPLED);
}

/* adam_body stepping its state in place (a donated step): each state one restrict
 * pointer, read and written (every element read before it is written); the working
 * copy (p_out) a buffer of its own. */
static inline __attribute__((always_inline)) void adam_block_in_place(
    const AdamHyper *h, const float *restrict g, float *restrict m, float *restrict a,
    float *restrict v, float *restrict p_out, int64_t n, const int CLIP, const int L2,
    const int DECOUPLED) {
    adam_body(h, g, m, a, v, m, a, v, p_out, n, CLIP, L2, DECOUPLED);
}

#define ADAM_FLAGS(X) \
    X(0, 0, 0) X(0, 0, 1) X(0, 1, 0) X(1, 0, 0) X(1, 0, 1) X(1, 1, 0) X(0, 1, 1) X(1, 1, 1)

/* In place where mo == m: a donated step, every state in place (the outputs are the
 * inputs); else every output a buffer of its own. po is never a state. */
static void adam_dispatch(const AdamHyper *h, const float *g, const float *m, const float *a,
                          const float *v, float *mo, float *ao, float *vo, float *po, int64_t n) {
#define ADAM_CASE(C, L, D)                                                   \
    if (h->clip == C && h->has_l2 == L && h->decoupled == D) {               \
        if (mo == m) adam_block_in_place(h, g, mo, ao, vo, po, n, C, L, D);  \
        else adam_block(h, g, m, a, v, mo, ao, vo, po, n, C, L, D);          \
        return;                                                              \
    }
    ADAM_FLAGS(ADAM_CASE)
#undef ADAM_CASE
}


#if defined(FF_SPLIT_LANES)
/* adam_block's step on a split master in registers (as sgd_lanes). */
typedef struct {
    __m512 inv, cd, cm, l2, b2, c2, sqrt_c2, inv_c1, eps, wd, factor, coef;
} AdamLanes;

static inline __attribute__((always_inline)) void adam_lanes(
    const AdamLanes c, int small_w, const char *g, int gd, const uint16_t *p, const int16_t *q,
    const float *a, const float *v, uint16_t *po, int16_t *qo, float *ao, float *vo, int64_t i,
    __mmask16 k, int stream, const int CLIP, const int L2, const int DECOUPLED) {
    __m512 u = _mm512_mul_ps(grad_lanes(g, gd, i, k), c.inv);
    if (CLIP) u = _mm512_mul_ps(_mm512_div_ps(u, c.cd), c.cm);
    const __m512 mi = master_lanes(p, q, i, k), ai = load_lanes(a, i, k);
    if (L2) u = _mm512_fmadd_ps(mi, c.l2, u);
    const __m512 na = _mm512_fmadd_ps(c.coef, _mm512_sub_ps(u, ai), small_w ? ai : u);
    const __m512 nv =
        _mm512_fmadd_ps(_mm512_mul_ps(c.c2, u), u, _mm512_mul_ps(load_lanes(v, i, k), c.b2));
    store_lanes(ao, i, na, k, stream);
    store_lanes(vo, i, nv, k, stream);
    __m512 st = _mm512_mul_ps(
        _mm512_div_ps(na, _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(nv), c.sqrt_c2), c.eps)),
        c.inv_c1);
    if (DECOUPLED) st = _mm512_fmadd_ps(mi, c.wd, st);
    store_split_lanes(po, qo, i, _mm512_fmadd_ps(st, c.factor, mi), k, stream);
}

static inline __attribute__((always_inline)) void adam_split_block(
    const AdamHyper *h, const char *g, int gd, const uint16_t *p, const int16_t *q,
    const float *a, const float *v, uint16_t *po, int16_t *qo, float *ao, float *vo, int64_t n,
    int stream, const int CLIP, const int L2, const int DECOUPLED) {
    const AdamLanes c = {_mm512_set1_ps(h->inv),     _mm512_set1_ps(h->clip_div),
                         _mm512_set1_ps(h->clip_mul), _mm512_set1_ps(h->l2),
                         _mm512_set1_ps(h->b2),      _mm512_set1_ps(h->c2),
                         _mm512_set1_ps(h->sqrt_c2), _mm512_set1_ps(h->inv_c1),
                         _mm512_set1_ps(h->eps),     _mm512_set1_ps(h->wd),
                         _mm512_set1_ps(h->factor),
                         _mm512_set1_ps(h->small_w ? h->w : h->w_minus_1)};
    const int small_w = h->small_w;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        ahead(g, i, dt_size(gd));
        ahead(p, i, 2);
        ahead(q, i, 2);
        ahead(a, i, 4);
        ahead(v, i, 4);
        adam_lanes(c, small_w, g, gd, p, q, a, v, po, qo, ao, vo, i, 0xFFFFu, stream, CLIP, L2,
                   DECOUPLED);
    }
    if (i < n)
        adam_lanes(c, small_w, g, gd, p, q, a, v, po, qo, ao, vo, i, lanes_left(n - i), stream,
                   CLIP, L2, DECOUPLED);
}
#endif

/* One block of ff_adam_update on a split master (as sgd_split): the moments a and v to ao
 * and vo. */
static void adam_split(const AdamHyper *h, const char *g, int gd, const uint16_t *p,
                       const int16_t *q, const float *a, const float *v, uint16_t *po,
                       int16_t *qo, float *ao, float *vo, int64_t n, int fresh) {
#if defined(FF_SPLIT_LANES)
    const int stream = streams(fresh, ao, po, qo) && ((uintptr_t)vo & 63u) == 0;
#define ADAM_CASE(C, L, D)                                                              \
    if (h->clip == C && h->has_l2 == L && h->decoupled == D) {                          \
        adam_split_block(h, g, gd, p, q, a, v, po, qo, ao, vo, n, stream, C, L, D);     \
        return;                                                                         \
    }
    ADAM_FLAGS(ADAM_CASE)
#undef ADAM_CASE
#else
    float gbuf[BLOCK], wbuf[BLOCK], mbuf[BLOCK], abuf[BLOCK], vbuf[BLOCK], pbuf[BLOCK];
    uint16_t pq[2 * BLOCK];
    to_f32(g, gbuf, n, gd);
    join_master(p, q, wbuf, n);
    adam_dispatch(h, gbuf, wbuf, a, v, mbuf, abuf, vbuf, pbuf, n);
    if (fresh) {
        stream_bytes(ao, abuf, n * 4);
        stream_bytes(vo, vbuf, n * 4);
    } else {
        memcpy(ao, abuf, (size_t)n * 4);
        memcpy(vo, vbuf, (size_t)n * 4);
    }
    store_split(mbuf, po, qo, pq, fresh, n);
#endif
}

/* Pointers per leaf: g (grad, dtype gdt), m (master), a and v (the moments),
 * p (old working copy, dtype pdt), and the outputs mo, ao, vo, po (the inputs
 * themselves when donating; po equal to mo, and p to m, for a leaf whose
 * working copy is its master). Per-group scalars read through pointers: inv
 * (NULL: 1), clip_div and clip_mul (NULL: no clipping), lr (the signed step
 * factor), apply (bool), inv_c1 = fl32(1 / (1 - b1^t)) and sqrt_c2 =
 * fl32(sqrt(1 - b2^t)). l2 and wd of 0: no decay of that kind. A skipped group
 * (apply false) leaves its outputs equal to its inputs, bit for bit. split: m and mo hold
 * int16 residuals of the FP16 working copies p and po, as in ff_sgd_update. */
void ff_adam_update(int64_t n_leaves, int64_t n_groups, void *const *g, float *const *m,
                    float *const *a, float *const *v, void *const *p, float *const *mo,
                    float *const *ao, float *const *vo, void *const *po, const int64_t *numel,
                    const int32_t *gdt, const int32_t *pdt, const float *inv,
                    const float *clip_div, const float *clip_mul, const float *lr,
                    const uint8_t *apply, const float *inv_c1, const float *sqrt_c2, float l2,
                    float w, float b2, float c2, float eps, float wd, int32_t split,
                    int32_t threads) {
    const int64_t per_group = n_leaves / n_groups;
    const int ms = split ? 2 : 4; /* bytes per element of the master (or residual) */
    AdamHyper *hs = (AdamHyper *)malloc((size_t)n_groups * sizeof(AdamHyper));
    for (int64_t k = 0; k < n_groups; ++k) {
        AdamHyper *h = &hs[k];
        h->inv = inv ? inv[k] : 1.0f;
        h->clip = clip_div != NULL;
        h->clip_div = h->clip ? clip_div[k] : 1.0f;
        h->clip_mul = h->clip ? clip_mul[k] : 1.0f;
        h->has_l2 = l2 != 0.0f;
        h->l2 = l2;
        h->w = w;
        h->w_minus_1 = w - 1.0f;
        h->small_w = fabsf(w) < 0.5f;
        h->b2 = b2;
        h->c2 = c2;
        h->sqrt_c2 = sqrt_c2[k];
        h->inv_c1 = inv_c1[k];
        h->eps = eps;
        h->decoupled = wd != 0.0f;
        h->wd = wd;
        h->factor = lr[k];
    }

    int64_t n_chunks;
    Chunk *chunks = make_chunks(n_leaves, numel, &n_chunks);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t k = 0; k < n_chunks; ++k) {
        const Chunk *c = &chunks[k];
        const int l = c->leaf;
        const int64_t grp = l / per_group;
        const AdamHyper *h = &hs[grp];
        const int gd = gdt[l], pd = pdt[l], gs = dt_size(gd), ps = dt_size(pd);
        const int p_is_master = po[l] == (void *)mo[l];
        const int donated = mo[l] == m[l];
        for (int64_t s = c->start; s < c->start + c->len; s += BLOCK) {
            const int64_t end = c->start + c->len, n = end - s < BLOCK ? end - s : BLOCK;
            char *po_s = (char *)po[l] + s * ps;
            if (!apply[grp]) {
                /* A skipped step: the new state is the old one, bit for bit. */
                if (!donated) {
                    memcpy((char *)mo[l] + s * ms, (const char *)m[l] + s * ms, (size_t)n * ms);
                    memcpy(ao[l] + s, a[l] + s, (size_t)n * 4);
                    memcpy(vo[l] + s, v[l] + s, (size_t)n * 4);
                    if (!p_is_master) memcpy(po_s, (const char *)p[l] + s * ps, (size_t)(n * ps));
                }
                continue;
            }
            if (split) {
                adam_split(h, (const char *)g[l] + s * gs, gd, (const uint16_t *)p[l] + s,
                           (const int16_t *)(const void *)m[l] + s, a[l] + s, v[l] + s,
                           (uint16_t *)(void *)po_s, (int16_t *)(void *)mo[l] + s, ao[l] + s,
                           vo[l] + s, n, !donated);
                continue;
            }
            float gbuf[BLOCK], pbuf[BLOCK], hbuf[BLOCK];
            to_f32((const char *)g[l] + s * gs, gbuf, n, gd);
            if (donated) { /* master and moments stepped in place */
                float *mo_s = mo[l] + s, *ao_s = ao[l] + s, *vo_s = vo[l] + s;
                adam_dispatch(h, gbuf, mo_s, ao_s, vo_s, mo_s, ao_s, vo_s, pbuf, n);
            } else {
                float mbuf[BLOCK], abuf[BLOCK], vbuf[BLOCK];
                adam_dispatch(h, gbuf, m[l] + s, a[l] + s, v[l] + s, mbuf, abuf, vbuf, pbuf, n);
                stream_bytes(mo[l] + s, mbuf, n * 4);
                stream_bytes(ao[l] + s, abuf, n * 4);
                stream_bytes(vo[l] + s, vbuf, n * 4);
            }
            if (!p_is_master) {
                from_f32(pbuf, hbuf, n, pd);
                stream_bytes(po_s, hbuf, n * ps);
            }
        }
        stream_fence();
    }
    free(chunks);
    free(hs);
}

/* ------------------------------------------------------------------------ */
/* The Lion update (fused_step.h's convention).                              */
/* ------------------------------------------------------------------------ */

/* Per element, as the reference chain scale_by_lion -> [decay] -> learning rate
 * computes it, with u the unscaled gradient and a the momentum:
 *
 *   c  = u * w1 + a * b1                  (two products and a sum, each rounded)
 *   d  = sign(c)                          (+-1, else +0: torch.sign's +-0 and NaN)
 *   d  = fma(m, wd, d)                    (decoupled decay only)
 *   m' = fma(d, f, m)                     (f = -lr: the allowed contraction)
 *   a' = u * w2 + a * b2
 *
 * hyper: w1 = 1 - b1, b1, w2 = 1 - b2, b2, wd (each rounded once to float32).
 */
typedef struct {
    float inv, clip_div, clip_mul, w1, b1, w2, b2, wd, factor;
    int clip, decoupled;
} LionHyper;

static inline __attribute__((always_inline)) void lion_body(
    const LionHyper *h, const float *g, const float *m,
    const float *a, float *m_out, float *a_out,
    float *p_out, int64_t n, const int CLIP, const int DECOUPLED) {
    const float inv = h->inv, cd = h->clip_div, cm = h->clip_mul, w1 = h->w1, b1 = h->b1,
                w2 = h->w2, b2 = h->b2, wd = h->wd, factor = h->factor;
    for (int64_t i = 0; i < n; ++i) {
        float u = g[i] * inv;
        if (CLIP) u = (u / cd) * cm;
        const float mi = m[i], ai = a[i];
        const float c = u * w1 + ai * b1;
        float d = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
        if (DECOUPLED) d = fmaf(mi, wd, d);
        const float nm = fmaf(d, factor, mi);
        a_out[i] = u * w2 + ai * b2;
        m_out[i] = nm;
        p_out[i] = nm;
    }
}

/* lion_body with every pointer restrict: a pure step, each output a buffer of its own. */
static inline __attribute__((always_inline)) void lion_block(
    const LionHyper *h, const float *restrict g, const float *restrict m,
    const float *restrict a, float *restrict m_out, float *restrict a_out,
    float *restrict p_out, int64_t n, const int CLIP, const int DECOUPLED) {
    lion_body(h, g, m, a, m_out, a_out, p_out, n, CLIP, DECOUPLED);
}

/* lion_body stepping its state in place (a donated step): each state one restrict
 * pointer, read and written (every element read before it is written); the working
 * copy (p_out) a buffer of its own. */
static inline __attribute__((always_inline)) void lion_block_in_place(
    const LionHyper *h, const float *restrict g, float *restrict m, float *restrict a,
    float *restrict p_out, int64_t n, const int CLIP, const int DECOUPLED) {
    lion_body(h, g, m, a, m, a, p_out, n, CLIP, DECOUPLED);
}

#define LION_FLAGS(X) X(0, 1) X(0, 0) X(1, 1) X(1, 0)

/* In place where mo == m: a donated step, every state in place (the outputs are the
 * inputs); else every output a buffer of its own. po is never a state. */
static void lion_dispatch(const LionHyper *h, const float *g, const float *m, const float *a,
                          float *mo, float *ao, float *po, int64_t n) {
#define LION_CASE(C, D)                                      \
    if (h->clip == C && h->decoupled == D) {                 \
        if (mo == m) lion_block_in_place(h, g, mo, ao, po, n, C, D);         \
        else lion_block(h, g, m, a, mo, ao, po, n, C, D);                    \
        return;                                              \
    }
    LION_FLAGS(LION_CASE)
#undef LION_CASE
}


#if defined(FF_SPLIT_LANES)
/* lion_block's step on a split master in registers (as sgd_lanes). */
typedef struct {
    __m512 inv, cd, cm, w1, b1, w2, b2, wd, factor;
} LionLanes;

static inline __attribute__((always_inline)) void lion_lanes(
    const LionLanes c, const char *g, int gd, const uint16_t *p, const int16_t *q,
    const float *a, uint16_t *po, int16_t *qo, float *ao, int64_t i, __mmask16 k, int stream,
    const int CLIP, const int DECOUPLED) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 u = _mm512_mul_ps(grad_lanes(g, gd, i, k), c.inv);
    if (CLIP) u = _mm512_mul_ps(_mm512_div_ps(u, c.cd), c.cm);
    const __m512 mi = master_lanes(p, q, i, k), ai = load_lanes(a, i, k);
    const __m512 s = _mm512_add_ps(_mm512_mul_ps(u, c.w1), _mm512_mul_ps(ai, c.b1));
    /* +1 above zero, -1 below, else +0 (zeros and NaN) */
    __m512 d = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, zero, _CMP_GT_OQ),
                                    _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, zero, _CMP_LT_OQ),
                                                         zero, _mm512_set1_ps(-1.0f)),
                                    _mm512_set1_ps(1.0f));
    if (DECOUPLED) d = _mm512_fmadd_ps(mi, c.wd, d);
    store_lanes(ao, i, _mm512_add_ps(_mm512_mul_ps(u, c.w2), _mm512_mul_ps(ai, c.b2)), k, stream);
    store_split_lanes(po, qo, i, _mm512_fmadd_ps(d, c.factor, mi), k, stream);
}

static inline __attribute__((always_inline)) void lion_split_block(
    const LionHyper *h, const char *g, int gd, const uint16_t *p, const int16_t *q,
    const float *a, uint16_t *po, int16_t *qo, float *ao, int64_t n, int stream,
    const int CLIP, const int DECOUPLED) {
    const LionLanes c = {_mm512_set1_ps(h->inv), _mm512_set1_ps(h->clip_div),
                         _mm512_set1_ps(h->clip_mul), _mm512_set1_ps(h->w1),
                         _mm512_set1_ps(h->b1),  _mm512_set1_ps(h->w2),
                         _mm512_set1_ps(h->b2),  _mm512_set1_ps(h->wd),
                         _mm512_set1_ps(h->factor)};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        ahead(g, i, dt_size(gd));
        ahead(p, i, 2);
        ahead(q, i, 2);
        ahead(a, i, 4);
        lion_lanes(c, g, gd, p, q, a, po, qo, ao, i, 0xFFFFu, stream, CLIP, DECOUPLED);
    }
    if (i < n)
        lion_lanes(c, g, gd, p, q, a, po, qo, ao, i, lanes_left(n - i), stream, CLIP, DECOUPLED);
}
#endif

/* One block of ff_lion_step on a split master (as sgd_split): the momentum a to ao. */
static void lion_split(const LionHyper *h, const char *g, int gd, const uint16_t *p,
                       const int16_t *q, const float *a, uint16_t *po, int16_t *qo, float *ao,
                       int64_t n, int fresh) {
#if defined(FF_SPLIT_LANES)
    const int stream = streams(fresh, ao, po, qo);
#define LION_CASE(C, D)                                                       \
    if (h->clip == C && h->decoupled == D) {                                  \
        lion_split_block(h, g, gd, p, q, a, po, qo, ao, n, stream, C, D);     \
        return;                                                               \
    }
    LION_FLAGS(LION_CASE)
#undef LION_CASE
#else
    float gbuf[BLOCK], wbuf[BLOCK], mbuf[BLOCK], abuf[BLOCK], pbuf[BLOCK];
    uint16_t pq[2 * BLOCK];
    to_f32(g, gbuf, n, gd);
    join_master(p, q, wbuf, n);
    lion_dispatch(h, gbuf, wbuf, a, mbuf, abuf, pbuf, n);
    if (fresh) stream_bytes(ao, abuf, n * 4);
    else memcpy(ao, abuf, (size_t)n * 4);
    store_split(mbuf, po, qo, pq, fresh, n);
#endif
}

static void ff_lion_step(const ff_step_args *x) {
    const int64_t per_group = x->n_leaves / x->n_groups;
    float *const *a = x->s[0];
    float *const *ao = x->so[0];
    LionHyper *hs = (LionHyper *)malloc((size_t)x->n_groups * sizeof(LionHyper));
    for (int64_t k = 0; k < x->n_groups; ++k) {
        LionHyper *h = &hs[k];
        h->inv = x->inv ? x->inv[k] : 1.0f;
        h->clip = x->clip_div != NULL;
        h->clip_div = h->clip ? x->clip_div[k] : 1.0f;
        h->clip_mul = h->clip ? x->clip_mul[k] : 1.0f;
        h->w1 = (float)x->hyper[0];
        h->b1 = (float)x->hyper[1];
        h->w2 = (float)x->hyper[2];
        h->b2 = (float)x->hyper[3];
        h->wd = (float)x->hyper[4];
        h->decoupled = h->wd != 0.0f;
        h->factor = x->lr[k];
    }
    int64_t n_chunks;
    Chunk *chunks = make_chunks(x->n_leaves, x->numel, &n_chunks);
#pragma omp parallel for schedule(static) num_threads(x->threads)
    for (int64_t k = 0; k < n_chunks; ++k) {
        const Chunk *c = &chunks[k];
        const int l = c->leaf;
        const int64_t grp = l / per_group;
        const LionHyper *h = &hs[grp];
        const int gd = x->gdt[l], pd = x->pdt[l], gs = dt_size(gd), ps = dt_size(pd);
        float *const m = x->m[l], *const mo = x->mo[l];
        const int p_is_master = x->po[l] == (void *)mo;
        const int donated = mo == m, ms = x->split ? 2 : 4;
        for (int64_t s = c->start; s < c->start + c->len; s += BLOCK) {
            const int64_t end = c->start + c->len, n = end - s < BLOCK ? end - s : BLOCK;
            char *po_s = (char *)x->po[l] + s * ps;
            if (!x->apply[grp]) {
                /* A skipped step: the new state is the old one, bit for bit. */
                if (!donated) {
                    memcpy((char *)mo + s * ms, (const char *)m + s * ms, (size_t)n * ms);
                    memcpy(ao[l] + s, a[l] + s, (size_t)n * 4);
                    if (!p_is_master)
                        memcpy(po_s, (const char *)x->p[l] + s * ps, (size_t)(n * ps));
                }
                continue;
            }
            if (x->split) {
                lion_split(h, (const char *)x->g[l] + s * gs, gd, (const uint16_t *)x->p[l] + s,
                           (const int16_t *)(const void *)m + s, a[l] + s,
                           (uint16_t *)(void *)po_s, (int16_t *)(void *)mo + s, ao[l] + s, n,
                           !donated);
                continue;
            }
            float gbuf[BLOCK], pbuf[BLOCK], hbuf[BLOCK];
            to_f32((const char *)x->g[l] + s * gs, gbuf, n, gd);
            if (donated) { /* master and momentum stepped in place */
                lion_dispatch(h, gbuf, mo + s, ao[l] + s, mo + s, ao[l] + s, pbuf, n);
            } else {
                float mbuf[BLOCK], abuf[BLOCK];
                lion_dispatch(h, gbuf, m + s, a[l] + s, mbuf, abuf, pbuf, n);
                stream_bytes(mo + s, mbuf, n * 4);
                stream_bytes(ao[l] + s, abuf, n * 4);
            }
            if (!p_is_master) {
                from_f32(pbuf, hbuf, n, pd);
                stream_bytes(po_s, hbuf, n * ps);
            }
        }
        stream_fence();
    }
    free(chunks);
    free(hs);
}

/* ------------------------------------------------------------------------ */
/* The RMSProp update (fused_step.h's convention).                           */
/* ------------------------------------------------------------------------ */

/* Per element, as the reference chain scale_by_rms -> learning rate -> [trace] computes
 * it (_fused/rmsprop.py), with u the unscaled gradient, v the average of squares and b
 * the trace, each operation rounded once but the multiply-adds that torch.addcmul and
 * torch.add(alpha=) contract on the CPU:
 *
 *   v' = fma(u * w, u, v * rho)                     (torch.addcmul's)
 *   s  = u / sqrt(v' + eps)   or   u / (sqrt(v') + eps)
 *   o  = s * f                                      (f: the signed learning rate)
 *   b' = b * keep + o                               (keep: mu once started, else 0)
 *   o  = b', or fma(b', mu, o) with Nesterov
 *   m' = m + o
 *
 * hyper: rho, eps, eps_in_sqrt, mu, nesterov; scalars[0] (with a trace): per group
 * whether momentum has started (1.0 or 0.0). s[0] is v, s[1] the trace.
 */
typedef struct {
    float inv, clip_div, clip_mul, rho, w, eps, factor, keep, mu;
    int clip, in_sqrt, trace, nesterov;
} RmsHyper;

static inline __attribute__((always_inline)) void rms_body(
    const RmsHyper *h, const float *g, const float *m,
    const float *v, const float *b, float *m_out,
    float *v_out, float *b_out, float *p_out, int64_t n,
    const int CLIP, const int IN_SQRT, const int TRACE, const int NESTEROV) {
    const float inv = h->inv, cd = h->clip_div, cm = h->clip_mul, rho = h->rho, w = h->w,
                eps = h->eps, factor = h->factor, keep = h->keep, mu = h->mu;
    for (int64_t i = 0; i < n; ++i) {
        float u = g[i] * inv;
        if (CLIP) u = (u / cd) * cm;
        const float nv = fmaf(u * w, u, v[i] * rho);
        const float den = IN_SQRT ? sqrtf(nv + eps) : sqrtf(nv) + eps;
        float o = (u / den) * factor;
        if (TRACE) {
            const float nb = b[i] * keep + o;
            b_out[i] = nb;
            o = NESTEROV ? fmaf(nb, mu, o) : nb;
        }
        const float nm = m[i] + o;
        v_out[i] = nv;
        m_out[i] = nm;
        p_out[i] = nm;
    }
}

/* rms_body with every pointer restrict: a pure step, each output a buffer of its own. */
static inline __attribute__((always_inline)) void rms_block(
    const RmsHyper *h, const float *restrict g, const float *restrict m,
    const float *restrict v, const float *restrict b, float *restrict m_out,
    float *restrict v_out, float *restrict b_out, float *restrict p_out, int64_t n,
    const int CLIP, const int IN_SQRT, const int TRACE, const int NESTEROV) {
    rms_body(h, g, m, v, b, m_out, v_out, b_out, p_out, n, CLIP, IN_SQRT, TRACE, NESTEROV);
}

/* rms_body stepping its state in place (a donated step): each state one restrict
 * pointer, read and written (every element read before it is written); the working
 * copy (p_out) a buffer of its own. */
static inline __attribute__((always_inline)) void rms_block_in_place(
    const RmsHyper *h, const float *restrict g, float *restrict m, float *restrict v,
    float *restrict b, float *restrict p_out, int64_t n, const int CLIP, const int IN_SQRT,
    const int TRACE, const int NESTEROV) {
    rms_body(h, g, m, v, b, m, v, b, p_out, n, CLIP, IN_SQRT, TRACE, NESTEROV);
}

#define RMS_FLAGS(X)                                                                    \
    X(0, 0, 0, 0) X(0, 1, 0, 0) X(1, 0, 0, 0) X(1, 1, 0, 0) X(0, 0, 1, 0) X(0, 1, 1, 0) \
    X(1, 0, 1, 0) X(1, 1, 1, 0) X(0, 0, 1, 1) X(0, 1, 1, 1) X(1, 0, 1, 1) X(1, 1, 1, 1)

/* In place where mo == m: a donated step, every state in place (the outputs are the
 * inputs); else every output a buffer of its own. po is never a state. */
static void rms_dispatch(const RmsHyper *h, const float *g, const float *m, const float *v,
                         const float *b, float *mo, float *vo, float *bo, float *po,
                         int64_t n) {
#define RMS_CASE(C, S, T, N)                                                       \
    if (h->clip == C && h->in_sqrt == S && h->trace == T && h->nesterov == N) {   \
        if (mo == m) rms_block_in_place(h, g, mo, vo, bo, po, n, C, S, T, N);     \
        else rms_block(h, g, m, v, b, mo, vo, bo, po, n, C, S, T, N);              \
        return;                                                                    \
    }
    RMS_FLAGS(RMS_CASE)
#undef RMS_CASE
}


static void ff_rmsprop_step(const ff_step_args *x) {
    const int64_t per_group = x->n_leaves / x->n_groups;
    const int trace = x->n_states > 1;
    float *const *v = x->s[0], *const *vo = x->so[0];
    float *const *b = trace ? x->s[1] : NULL, *const *bo = trace ? x->so[1] : NULL;
    RmsHyper *hs = (RmsHyper *)malloc((size_t)x->n_groups * sizeof(RmsHyper));
    for (int64_t k = 0; k < x->n_groups; ++k) {
        RmsHyper *h = &hs[k];
        h->inv = x->inv ? x->inv[k] : 1.0f;
        h->clip = x->clip_div != NULL;
        h->clip_div = h->clip ? x->clip_div[k] : 1.0f;
        h->clip_mul = h->clip ? x->clip_mul[k] : 1.0f;
        h->rho = (float)x->hyper[0];
        h->w = (float)(1.0 - x->hyper[0]);
        h->eps = (float)x->hyper[1];
        h->in_sqrt = x->hyper[2] != 0.0;
        h->mu = (float)x->hyper[3];
        h->trace = trace;
        h->nesterov = trace && x->hyper[4] != 0.0;
        h->keep = trace && x->n_scalars > 0 && x->scalars[0][k] != 0.0f ? h->mu : 0.0f;
        h->factor = x->lr[k];
    }
    int64_t n_chunks;
    Chunk *chunks = make_chunks(x->n_leaves, x->numel, &n_chunks);
#pragma omp parallel for schedule(static) num_threads(x->threads)
    for (int64_t k = 0; k < n_chunks; ++k) {
        const Chunk *c = &chunks[k];
        const int l = c->leaf;
        const int64_t grp = l / per_group;
        const RmsHyper *h = &hs[grp];
        const int gd = x->gdt[l], pd = x->pdt[l], gs = dt_size(gd), ps = dt_size(pd);
        float *const m = x->m[l], *const mo = x->mo[l];
        const int p_is_master = x->po[l] == (void *)mo;
        const int donated = mo == m, ms = x->split ? 2 : 4;
        for (int64_t s = c->start; s < c->start + c->len; s += BLOCK) {
            const int64_t end = c->start + c->len, n = end - s < BLOCK ? end - s : BLOCK;
            char *po_s = (char *)x->po[l] + s * ps;
            if (!x->apply[grp]) {
                /* A skipped step: the new state is the old one, bit for bit. */
                if (!donated) {
                    memcpy((char *)mo + s * ms, (const char *)m + s * ms, (size_t)n * ms);
                    memcpy(vo[l] + s, v[l] + s, (size_t)n * 4);
                    if (trace) memcpy(bo[l] + s, b[l] + s, (size_t)n * 4);
                    if (!p_is_master)
                        memcpy(po_s, (const char *)x->p[l] + s * ps, (size_t)(n * ps));
                }
                continue;
            }
            float gbuf[BLOCK], jbuf[BLOCK], mbuf[BLOCK], vbuf[BLOCK], bbuf[BLOCK], pbuf[BLOCK];
            uint16_t hbuf[2 * BLOCK];
            to_f32((const char *)x->g[l] + s * gs, gbuf, n, gd);
            const float *m_in = m + s;
            if (x->split) { /* the master joined from its halves, stepped, split again */
                join_master((const uint16_t *)x->p[l] + s, (const int16_t *)(const void *)m + s,
                            jbuf, n);
                m_in = jbuf;
            }
            const float *b_in = trace ? b[l] + s : NULL;
            if (donated && !x->split) { /* master, nu and trace stepped in place */
                float *bo_s = trace ? bo[l] + s : NULL;
                rms_dispatch(h, gbuf, mo + s, vo[l] + s, bo_s, mo + s, vo[l] + s, bo_s, pbuf, n);
            } else { /* the block's outputs to its buffers, then in place or streamed */
                rms_dispatch(h, gbuf, m_in, v[l] + s, b_in, mbuf, vbuf, bbuf, pbuf, n);
                if (donated) {
                    memcpy(vo[l] + s, vbuf, (size_t)n * 4);
                    if (trace) memcpy(bo[l] + s, bbuf, (size_t)n * 4);
                } else {
                    stream_bytes(vo[l] + s, vbuf, n * 4);
                    if (trace) stream_bytes(bo[l] + s, bbuf, n * 4);
                }
                if (x->split) {
                    store_split(mbuf, po_s, (int16_t *)(void *)mo + s, hbuf, !donated, n);
                    continue;
                }
                stream_bytes(mo + s, mbuf, n * 4);
            }
            if (!p_is_master) {
                from_f32(pbuf, hbuf, n, pd);
                stream_bytes(po_s, hbuf, n * ps);
            }
        }
        stream_fence();
    }
    free(chunks);
    free(hs);
}

/* ------------------------------------------------------------------------ */
/* Stored moments: BF16, FP16 and 8-bit E4M3 block codes, inside the step.   */
/* ------------------------------------------------------------------------ */

/* A moment of a leaf is kept in one of these forms (moment_storage.py):
 *
 *   ST_F32   float32, itself;
 *   ST_F16   float16, rn16(x) or stochastically rounded;
 *   ST_BF16  bfloat16, likewise;
 *   ST_E4M3  one byte per element, the E4M3 code of x / a, with a = A / 448
 *            per block (A: the block's largest finite |x|; a = 1 where that
 *            is 0); a second moment codes its square root and decodes to the
 *            square.
 *
 * Blocks are block_size consecutive elements of a row (everything after the
 * first dimension), a row's last block possibly shorter. A leaf with a coded
 * moment is walked block by block: decode into float32 buffers, one step of
 * the optimiser's arithmetic, find each new block's scale, encode. The
 * rounding of every stored form is to nearest (ties to even), or stochastic:
 * up with probability (x - l) / (h - l) (with a root, of the squares), from a
 * 32-bit hash of x's bits and a salt of (count, stream, leaf index), exactly
 * as stochastic_rounding.py computes it. */
enum { ST_F32 = 0, ST_F16 = 1, ST_BF16 = 2, ST_E4M3 = 3 };

#define E4M3_MAX 448.0f


/* The E4M3 code of x, rounded to nearest with ties to even (|x| <= 448, or NaN).
 * Branch-free, so that a loop of it vectorises. */
static inline uint8_t e4m3_code(float x) {
    const uint32_t u = f32_bits(x);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7FFFFFFFu;
    /* below 2^-6: the subnormal grid, spacing 2^-9 (q = 8 is 2^-6, the smallest normal) */
    const uint32_t sub = (uint32_t)nearbyintf(bits_f32(a) * 512.0f);
    /* normal: keep 3 mantissa bits, the 20 dropped ones rounded to nearest even */
    const uint32_t rounded = a + 0x7FFFFu + ((a >> 20) & 1u);
    const uint32_t normal = ((((rounded >> 23) - 120u) << 3) | ((rounded >> 20) & 7u)) & 0x7Fu;
    const uint32_t code = a > 0x7F800000u ? 0x7Fu : (a < 0x3C800000u ? sub : normal);
    return (uint8_t)(sign | code);
}

/* The value of an E4M3 code, computed (a loop of it vectorises; a table is a gather). */
static inline float e4m3_value(uint8_t code) {
    const uint32_t c = code & 0x7Fu;
    const float normal = bits_f32((c << 20) + (120u << 23));
    const float sub = (float)(int32_t)c * 0x1p-9f;
    const float v = c == 0x7Fu ? NAN : (c < 8u ? sub : normal);
    return code & 0x80u ? -v : v;
}

static inline uint32_t mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    return h ^ (h >> 16);
}

#define GOLDEN 0x9E3779B1u

/* stochastic_rounding.salt(count, stream, leaf). */
static uint32_t sr_salt(int64_t count, uint32_t stream, int64_t leaf) {
    const uint32_t fixed = mix32(mix32(stream) + (uint32_t)leaf * GOLDEN);
    return mix32((uint32_t)count * GOLDEN + fixed);
}

/* stochastic_rounding.round_stochastic(x, mb, emin, random_bits(x, salt)), branch-free:
 * the magnitude's neighbours l <= |x| < l + s on the grid (s = 2^t), away from zero where
 * the top d bits of the hash are under the d bits of |x|'s pattern below s (|x| >= s), or
 * where u s < |x| (|x| < s, l = 0). (Squares, for E4M3 roots only: e4m3_sr_code.) */
static inline float round_sr(float x, int mb, int emin, uint32_t salt) {
    const uint32_t bx = f32_bits(x), r = mix32(bx ^ salt);
    const uint32_t mag = bx & 0x7FFFFFFFu;
    const int b = (int)(mag >> 23);
    const int t = (b - 127 > emin ? b - 127 : emin) - mb;
    const int d = t - ((b > 1 ? b : 1) - 150); /* bits of the pattern below 2^t */
    const int tiny = d > 23;
    const int dn = tiny ? 23 : d;
    const uint32_t low = mag & ((1u << dn) - 1u);
    const float l = bits_f32(tiny ? 0u : mag - low);
    const float s = t >= -126 ? bits_f32((uint32_t)(t + 127) << 23)
                              : bits_f32(1u << ((t + 149) & 31));
    const float xa = bits_f32(mag), u = (float)(r >> 8) * 0x1p-24f;
    const int away = tiny ? u * s < xa : (r >> (32 - dn)) < low;
    const float out = away ? l + s : l;
    return b == 255 ? x : copysignf(out, x);
}

/* round_sr onto bfloat16's grid, straight to its bits: every float32 pattern has 16 bits
 * below bfloat16's spacing, so adding 2^16 - 1 - (r >> 16) carries into the kept bits
 * exactly where r >> 16 is under them. */
static inline uint16_t bf16_sr(float x, uint32_t salt) {
    const uint32_t bx = f32_bits(x), r = mix32(bx ^ salt);
    return x != x ? (uint16_t)0x7FC0u : (uint16_t)((bx + (~r >> 16)) >> 16);
}

/* The E4M3 code of round_stochastic(v, 3, -6, random_bits(v, salt), square=SQ) for |v| <=
 * 448 or NaN, mostly in integers: E4M3's codes count its grid, so the code of |v|'s lower neighbour is the bits of |v|'s pattern
 * above the spacing (from 2^-6, b >= 121: (mag >> 20) - 960; below it the significand's
 * bits above 2^-9: sig >> (141 - b)) and the upper neighbour's is one more. */
static inline uint8_t e4m3_sr_code(float v, uint32_t salt, const int SQ) {
    const uint32_t bx = f32_bits(v), r = mix32(bx ^ salt);
    const uint32_t mag = bx & 0x7FFFFFFFu, sign = (bx >> 24) & 0x80u;
    const int b = (int)(mag >> 23);
    const int normal = b >= 121, tiny = b < 118; /* tiny: |v| < 2^-9, neighbours 0 and 2^-9 */
    const int d = normal ? 20 : (tiny ? 23 : 141 - b);
    const uint32_t low = mag & ((1u << d) - 1u);
    const uint32_t sig = (mag & 0x7FFFFFu) | 0x800000u;
    const uint32_t base = normal ? (mag >> 20) - 960u : (tiny ? 0u : sig >> d);
    const float xa = bits_f32(mag), u = (float)(r >> 8) * 0x1p-24f;
    int away;
    if (SQ) {
        const float l = bits_f32(tiny ? 0u : mag - low);
        const float s = bits_f32((uint32_t)(normal ? b - 3 : 118) << 23);      /* 2^t */
        const float inv_s = bits_f32((uint32_t)(normal ? 257 - b : 136) << 23); /* 2^-t */
        away = u * (l + l + s) < ((xa - l) * inv_s) * (xa + l);
    } else {
        away = tiny ? u * 0x1p-9f < xa : (r >> (32 - d)) < low;
    }
    return (uint8_t)(sign | (b == 255 ? 0x7Fu : base + (uint32_t)away));
}

/* Decodes n elements of a stored moment starting at element s into dst. */
static void decode_moment(int st, const void *src, const float *scale, int root, float *dst,
                          int64_t s, int64_t n) {
    if (st == ST_F32) {
        memcpy(dst, (const float *)src + s, (size_t)n * 4);
    } else if (st == ST_BF16) {
        to_f32((const uint16_t *)src + s, dst, n, DT_BF16);
    } else if (st == ST_F16) {
        to_f32((const uint16_t *)src + s, dst, n, DT_F16);
    } else {
        const uint8_t *q = (const uint8_t *)src + s;
        const float a = *scale;
        for (int64_t i = 0; i < n; ++i) dst[i] = e4m3_value(q[i]) * a;
        if (root)
            for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] * dst[i];
    }
}

static void encode_block(const float *y, float peak, uint8_t *q, float *scale_out, int root,
                         int sr, uint32_t salt, int64_t n);

/* Encodes n float32 values x (the new moment) into dst at element s; for a coded
 * moment, x is one block and its scale goes to *scale_out. salt: 0 and sr false
 * for rounding to nearest. tmp: n floats of scratch. */
static void encode_moment(int st, const float *x, void *dst, float *scale_out, int root,
                          int sr, uint32_t salt, float *tmp, int64_t s, int64_t n) {
    if (st == ST_F32) {
        memcpy((float *)dst + s, x, (size_t)n * 4);
        return;
    }
    if (st == ST_BF16 || st == ST_F16) {
        const int dt = st == ST_BF16 ? DT_BF16 : DT_F16;
        if (!sr) {
            from_f32(x, (uint16_t *)dst + s, n, dt);
            return;
        }
        if (st == ST_BF16) {
            uint16_t *d = (uint16_t *)dst + s;
            for (int64_t i = 0; i < n; ++i) d[i] = bf16_sr(x[i], salt);
            return;
        }
        for (int64_t i = 0; i < n; ++i) tmp[i] = round_sr(x[i], 10, -14, salt);
        from_f32(tmp, (uint16_t *)dst + s, n, dt);
        return;
    }
    /* A block: its largest finite magnitude, its scale, its codes. */
    const float *y = x;
    if (root) {
        for (int64_t i = 0; i < n; ++i) tmp[i] = sqrtf(x[i]);
        y = tmp;
    }
    float peak = 0.0f;
#pragma omp simd reduction(max : peak)
    for (int64_t i = 0; i < n; ++i) {
        float m = fabsf(y[i]);
        m = m < INFINITY ? m : 0.0f; /* an inf or NaN is left out */
        peak = m > peak ? m : peak;
    }
    encode_block(y, peak, (uint8_t *)dst + s, scale_out, root, sr, salt, n);
}

/* y / a, clamped to +-448 (a NaN stays NaN): the value an E4M3 code is rounded from. */
static inline __attribute__((always_inline)) float e4m3_quotient(float y, float a) {
    const float v = y / a;
    return v > E4M3_MAX ? E4M3_MAX : (v < -E4M3_MAX ? -E4M3_MAX : v);
}

/* The codes of n values y with scale a (n a multiple of TAIL, or any n where speed does not
 * matter): y / a clamped, rounded to nearest or stochastically (SR; SQ: of the squares). */
static inline __attribute__((always_inline)) void e4m3_codes(const float *restrict y, float a,
                                                             uint8_t *restrict q, uint32_t salt,
                                                             int64_t n, const int SR,
                                                             const int SQ) {
    for (int64_t i = 0; i < n; ++i) {
        const float v = e4m3_quotient(y[i], a);
        q[i] = SR ? e4m3_sr_code(v, salt, SQ) : e4m3_code(v);
    }
}

/* Element loops run whole vectors: the last n % TAIL elements of a block go through the
 * same loop as one padded run of TAIL (a remainder loop the compiler leaves scalar made
 * a row of 1000 elements' last block cost as much as the rest of the row). */
#define TAIL 64

static void e4m3_codes_of(const float *y, float a, uint8_t *q, int sr, int root, uint32_t salt,
                          int64_t n) {
    if (!sr) e4m3_codes(y, a, q, 0, n, 0, 0);
    else if (root) e4m3_codes(y, a, q, salt, n, 1, 1);
    else e4m3_codes(y, a, q, salt, n, 1, 0);
}

/* The codes of one block y (a second moment's roots where root) whose largest finite
 * magnitude is peak, and its scale into *scale_out. */
static void encode_block(const float *y, float peak, uint8_t *q, float *scale_out, int root,
                         int sr, uint32_t salt, int64_t n) {
    float a = peak / E4M3_MAX;
    if (!(a > 0.0f)) a = 1.0f;
    *scale_out = a;
    const int64_t whole = n - n % TAIL;
    e4m3_codes_of(y, a, q, sr, root, salt, whole);
    if (whole < n) {
        float ty[TAIL] = {0.0f};
        uint8_t tq[TAIL];
        memcpy(ty, y + whole, (size_t)(n - whole) * 4);
        e4m3_codes_of(ty, a, tq, sr, root, salt, TAIL);
        memcpy(q + whole, tq, (size_t)(n - whole));
    }
}

/* adam_block with both moments in bfloat16, read and written in the element loop itself
 * (every stream in flight together, no buffers): rounded to nearest, or stochastically
 * with the salts (SR). */
static inline __attribute__((always_inline)) void adam_bf16_body(
    const AdamHyper *h, const float *g, const float *m,
    const uint16_t *a, const uint16_t *v, float *m_out, uint16_t *a_out, uint16_t *v_out,
    float *p_out, int64_t n, uint32_t salt_a, uint32_t salt_v, const int CLIP, const int L2,
    const int DECOUPLED, const int SR) {
    const float inv = h->inv, cd = h->clip_div, cm = h->clip_mul, l2 = h->l2, b2 = h->b2,
                c2 = h->c2, sqrt_c2 = h->sqrt_c2, inv_c1 = h->inv_c1, eps = h->eps, wd = h->wd,
                factor = h->factor;
    const float coef = h->small_w ? h->w : h->w_minus_1;
    const int small_w = h->small_w;
    for (int64_t i = 0; i < n; ++i) {
        float u = g[i] * inv;
        if (CLIP) u = (u / cd) * cm;
        const float mi = m[i], ai = bf16_to_f32(a[i]), vi = bf16_to_f32(v[i]);
        if (L2) u = fmaf(mi, l2, u);
        const float na = fmaf(coef, u - ai, small_w ? ai : u);
        const float nv = fmaf(c2 * u, u, vi * b2);
        float s_ = (na / (sqrtf(nv) / sqrt_c2 + eps)) * inv_c1;
        if (DECOUPLED) s_ = fmaf(mi, wd, s_);
        const float nm = fmaf(s_, factor, mi);
        m_out[i] = nm;
        p_out[i] = nm;
        if (SR) {
            a_out[i] = bf16_sr(na, salt_a);
            v_out[i] = bf16_sr(nv, salt_v);
        } else {
            a_out[i] = f32_to_bf16(na);
            v_out[i] = f32_to_bf16(nv);
        }
    }
}

/* adam_bf16_body with every pointer restrict, in the three ways a stored step calls it:
 * pure (every output a buffer of its own), donated (master and moments in place) and
 * donated with a split master (the moments in place, the master joined into a buffer and
 * stepped into another). */
static inline __attribute__((always_inline)) void adam_block_bf16(
    const AdamHyper *h, const float *restrict g, const float *restrict m,
    const uint16_t *restrict a, const uint16_t *restrict v, float *restrict m_out,
    uint16_t *restrict a_out, uint16_t *restrict v_out, float *restrict p_out, int64_t n,
    uint32_t salt_a, uint32_t salt_v, const int CLIP, const int L2, const int DECOUPLED,
    const int SR) {
    adam_bf16_body(h, g, m, a, v, m_out, a_out, v_out, p_out, n, salt_a, salt_v, CLIP, L2,
                   DECOUPLED, SR);
}

static inline __attribute__((always_inline)) void adam_block_bf16_in_place(
    const AdamHyper *h, const float *restrict g, float *restrict m, uint16_t *restrict a,
    uint16_t *restrict v, float *restrict p_out, int64_t n, uint32_t salt_a, uint32_t salt_v,
    const int CLIP, const int L2, const int DECOUPLED, const int SR) {
    adam_bf16_body(h, g, m, a, v, m, a, v, p_out, n, salt_a, salt_v, CLIP, L2, DECOUPLED, SR);
}

static inline __attribute__((always_inline)) void adam_block_bf16_moments_in_place(
    const AdamHyper *h, const float *restrict g, const float *restrict m, uint16_t *restrict a,
    uint16_t *restrict v, float *restrict m_out, float *restrict p_out, int64_t n,
    uint32_t salt_a, uint32_t salt_v, const int CLIP, const int L2, const int DECOUPLED,
    const int SR) {
    adam_bf16_body(h, g, m, a, v, m_out, a, v, p_out, n, salt_a, salt_v, CLIP, L2, DECOUPLED,
                   SR);
}

static void adam_bf16_dispatch(const AdamHyper *h, const float *g, const float *m,
                               const uint16_t *a, const uint16_t *v, float *mo, uint16_t *ao,
                               uint16_t *vo, float *po, int64_t n, int sr, uint32_t salt_a,
                               uint32_t salt_v) {
#define BF16_CASE(C, L, D, S)                                                                \
    if (h->clip == C && h->has_l2 == L && h->decoupled == D && sr == S) {                    \
        if (mo == m)                                                                         \
            adam_block_bf16_in_place(h, g, mo, ao, vo, po, n, salt_a, salt_v, C, L, D, S);   \
        else if (ao == a)                                                                    \
            adam_block_bf16_moments_in_place(h, g, m, ao, vo, mo, po, n, salt_a, salt_v, C,  \
                                             L, D, S);                                       \
        else                                                                                 \
            adam_block_bf16(h, g, m, a, v, mo, ao, vo, po, n, salt_a, salt_v, C, L, D, S);   \
        return;                                                                              \
    }
#define BF16_SR(C, L, D) BF16_CASE(C, L, D, 0) BF16_CASE(C, L, D, 1)
    BF16_SR(0, 0, 0) BF16_SR(0, 0, 1) BF16_SR(0, 1, 0) BF16_SR(1, 0, 0)
    BF16_SR(1, 0, 1) BF16_SR(1, 1, 0) BF16_SR(0, 1, 1) BF16_SR(1, 1, 1)
#undef BF16_SR
#undef BF16_CASE
}

/* adam_block reading both moments as E4M3 codes of one block (scales sa, sv; the second
 * moment through its root), decoded in the element loop itself; the new first moment and
 * the new second moment's root (the denominator's own sqrtf(v')) go to float32 buffers
 * for the block's encoding, with each one's largest finite magnitude (peaks[0], [1]). */
static inline __attribute__((always_inline)) void adam_block_e4m3(
    const AdamHyper *h, const float *restrict g, const float *m,
    const uint8_t *restrict a, const uint8_t *restrict v, float sa, float sv, float *m_out,
    float *restrict na_out, float *restrict nr_out, float *p_out, float *peaks, int64_t n,
    const int CLIP, const int L2, const int DECOUPLED) {
    const float inv = h->inv, cd = h->clip_div, cm = h->clip_mul, l2 = h->l2, b2 = h->b2,
                c2 = h->c2, sqrt_c2 = h->sqrt_c2, inv_c1 = h->inv_c1, eps = h->eps, wd = h->wd,
                factor = h->factor;
    const float coef = h->small_w ? h->w : h->w_minus_1;
    const int small_w = h->small_w;
    float pa = 0.0f, pr = 0.0f;
#pragma omp simd reduction(max : pa, pr)
    for (int64_t i = 0; i < n; ++i) {
        float u = g[i] * inv;
        if (CLIP) u = (u / cd) * cm;
        const float mi = m[i], ai = e4m3_value(a[i]) * sa, ri = e4m3_value(v[i]) * sv;
        const float vi = ri * ri;
        if (L2) u = fmaf(mi, l2, u);
        const float na = fmaf(coef, u - ai, small_w ? ai : u);
        const float nv = fmaf(c2 * u, u, vi * b2);
        const float nr = sqrtf(nv);
        float s_ = (na / (nr / sqrt_c2 + eps)) * inv_c1;
        if (DECOUPLED) s_ = fmaf(mi, wd, s_);
        const float nm = fmaf(s_, factor, mi);
        m_out[i] = nm;
        p_out[i] = nm;
        na_out[i] = na;
        nr_out[i] = nr;
        float fa = fabsf(na), fr = fabsf(nr);
        fa = fa < INFINITY ? fa : 0.0f; /* an inf or NaN is left out of its block's scale */
        fr = fr < INFINITY ? fr : 0.0f;
        pa = fa > pa ? fa : pa;
        pr = fr > pr ? fr : pr;
    }
    peaks[0] = pa;
    peaks[1] = pr;
}

static void adam_e4m3_whole(const AdamHyper *h, const float *g, const float *m,
                            const uint8_t *a, const uint8_t *v, float sa, float sv, float *mo,
                            float *na, float *nr, float *po, float *peaks, int64_t n) {
#define E4M3_CASE(C, L, D)                                                         \
    if (h->clip == C && h->has_l2 == L && h->decoupled == D) {                     \
        adam_block_e4m3(h, g, m, a, v, sa, sv, mo, na, nr, po, peaks, n, C, L, D); \
        return;                                                                    \
    }
    E4M3_CASE(0, 0, 0) E4M3_CASE(0, 0, 1) E4M3_CASE(0, 1, 0) E4M3_CASE(1, 0, 0)
    E4M3_CASE(1, 0, 1) E4M3_CASE(1, 1, 0) E4M3_CASE(0, 1, 1) E4M3_CASE(1, 1, 1)
#undef E4M3_CASE
}

/* adam_block_e4m3 over n elements in whole vectors (TAIL): the last n % TAIL run padded with
 * zeros (a zero gradient, master and code give zero moments, so the peaks stand). na and nr
 * hold n rounded up to TAIL floats. */
static void adam_e4m3_dispatch(const AdamHyper *h, const float *g, const float *m,
                               const uint8_t *a, const uint8_t *v, float sa, float sv, float *mo,
                               float *na, float *nr, float *po, float *peaks, int64_t n) {
    const int64_t whole = n - n % TAIL, rest = n - whole;
    peaks[0] = peaks[1] = 0.0f;
    if (whole) adam_e4m3_whole(h, g, m, a, v, sa, sv, mo, na, nr, po, peaks, whole);
    if (!rest) return;
    float tg[TAIL] = {0.0f}, tm[TAIL] = {0.0f}, tmo[TAIL], tpo[TAIL], tail_peaks[2];
    uint8_t ta[TAIL] = {0}, tv[TAIL] = {0};
    memcpy(tg, g + whole, (size_t)rest * 4);
    memcpy(tm, m + whole, (size_t)rest * 4);
    memcpy(ta, a + whole, (size_t)rest);
    memcpy(tv, v + whole, (size_t)rest);
    adam_e4m3_whole(h, tg, tm, ta, tv, sa, sv, tmo, na + whole, nr + whole, tpo, tail_peaks,
                    TAIL);
    memcpy(mo + whole, tmo, (size_t)rest * 4);
    memcpy(po + whole, tpo, (size_t)rest * 4);
    peaks[0] = tail_peaks[0] > peaks[0] ? tail_peaks[0] : peaks[0];
    peaks[1] = tail_peaks[1] > peaks[1] ? tail_peaks[1] : peaks[1];
}

/* A step of fused_step.h's convention with stored states, for Adam/AdamW (kind ADAM:
 * s[0], s[1] the moments mu, nu; scalars inv_c1, sqrt_c2; hyper l2, w, b2, c2, eps, wd)
 * Lion (kind LION: s[0] the momentum; hyper w1, b1, w2, b2, wd) and SGD with momentum
 * (kind SGD: s[0] the trace; scalars: started (0 or 1); hyper wd, momentum, 1 - dampening,
 * nesterov). sdt[j][l] says how
 * state j of leaf l is stored, sc[j][l] holds its block scales where it is coded (the
 * second state through its root where x->root). counts[k]: group k's applied-step count
 * (the salt), salt_ids[l] each leaf's index in the optimiser's tree. */
/* A segment's last writes: the new master from its buffer (not donated: a donated step
 * wrote it in place) and the working copy converted from pbuf, both streamed; for a split
 * master, the params and residuals split from mbuf (hbuf: room for both). */
static inline void finish_segment(void *mo, float *mbuf, int donated, char *po,
                                  const float *pbuf, void *hbuf, int p_is_master, int pd,
                                  int ps, int split, int64_t n) {
    if (split) { /* params and residuals of the new master (in mbuf) */
        store_split(mbuf, po, mo, (uint16_t *)hbuf, !donated, n);
        return;
    }
    if (!donated) stream_bytes(mo, mbuf, n * 4);
    if (!p_is_master) {
        from_f32(pbuf, hbuf, n, pd);
        stream_bytes(po, hbuf, n * ps);
    }
}

enum { STORED_ADAM = 0, STORED_LION = 1, STORED_SGD = 2 };

static void stored_step(const ff_step_args *x, const int kind) {
    const int64_t per_group = x->n_leaves / x->n_groups;
    const int n_states = kind == STORED_ADAM ? 2 : 1;
    AdamHyper *hs = (AdamHyper *)calloc((size_t)x->n_groups, sizeof(AdamHyper));
    LionHyper *hl = (LionHyper *)calloc((size_t)x->n_groups, sizeof(LionHyper));
    Hyper *hg = (Hyper *)calloc((size_t)x->n_groups, sizeof(Hyper));
    for (int64_t k = 0; k < x->n_groups; ++k) {
        const float inv = x->inv ? x->inv[k] : 1.0f;
        const int clip = x->clip_div != NULL;
        const float cd = clip ? x->clip_div[k] : 1.0f, cm = clip ? x->clip_mul[k] : 1.0f;
        if (kind == STORED_SGD) { /* as ff_sgd_update, momentum on */
            Hyper *h = &hg[k];
            h->inv = inv, h->clip = clip, h->clip_div = cd, h->clip_mul = cm;
            h->wd = (float)x->hyper[0];
            h->decay = h->wd != 0.0f;
            h->momentum = 1;
            h->mu = (float)x->hyper[1];
            const int started = x->scalars[0][k] != 0.0f;
            h->keep = started ? h->mu : 0.0f;
            h->take = started ? (float)x->hyper[2] : 1.0f;
            h->nesterov = x->hyper[3] != 0.0;
            h->factor = x->lr[k];
            continue;
        }
        if (kind == STORED_LION) {
            LionHyper *h = &hl[k];
            h->inv = inv, h->clip = clip, h->clip_div = cd, h->clip_mul = cm;
            h->w1 = (float)x->hyper[0];
            h->b1 = (float)x->hyper[1];
            h->w2 = (float)x->hyper[2];
            h->b2 = (float)x->hyper[3];
            h->wd = (float)x->hyper[4];
            h->decoupled = h->wd != 0.0f;
            h->factor = x->lr[k];
            continue;
        }
        AdamHyper *h = &hs[k];
        h->inv = inv, h->clip = clip, h->clip_div = cd, h->clip_mul = cm;
        h->l2 = (float)x->hyper[0];
        h->has_l2 = h->l2 != 0.0f;
        h->w = (float)x->hyper[1];
        h->w_minus_1 = h->w - 1.0f;
        h->small_w = fabsf(h->w) < 0.5f;
        h->b2 = (float)x->hyper[2];
        h->c2 = (float)x->hyper[3];
        h->eps = (float)x->hyper[4];
        h->wd = (float)x->hyper[5];
        h->decoupled = h->wd != 0.0f;
        h->inv_c1 = x->scalars[0][k];
        h->sqrt_c2 = x->scalars[1][k];
        h->factor = x->lr[k];
    }
    const int64_t bs = x->block_size;
    const int sr = x->rounding;
    /* Work units: the leaves' segments (a coded leaf's blocks, else BLOCK-element pieces),
     * about CHUNK elements of consecutive segments each. */
    int64_t n_units = 0;
    int64_t *seg = (int64_t *)malloc((size_t)x->n_leaves * 3 * sizeof(int64_t));
    for (int64_t l = 0; l < x->n_leaves; ++l) {
        const int coded = x->sdt[0][l] == ST_E4M3 || (n_states > 1 && x->sdt[1][l] == ST_E4M3);
        const int64_t rows = coded ? x->rows[l] : 1;
        const int64_t len = rows ? x->numel[l] / rows : 0;
        const int64_t width = coded ? bs : BLOCK;
        seg[3 * l] = len;                                       /* row length */
        seg[3 * l + 1] = width;                                 /* segment length */
        seg[3 * l + 2] = rows * ((len + width - 1) / width);    /* segments */
        const int64_t per_unit = width >= CHUNK ? 1 : CHUNK / width;
        n_units += (seg[3 * l + 2] + per_unit - 1) / per_unit;
    }
    int64_t *units = (int64_t *)malloc((size_t)(n_units ? n_units : 1) * 3 * sizeof(int64_t));
    {
        int64_t u = 0;
        for (int64_t l = 0; l < x->n_leaves; ++l) {
            const int64_t width = seg[3 * l + 1], per_unit = width >= CHUNK ? 1 : CHUNK / width;
            for (int64_t q = 0; q < seg[3 * l + 2]; q += per_unit) {
                units[3 * u] = l;
                units[3 * u + 1] = q;
                units[3 * u + 2] = seg[3 * l + 2] - q < per_unit ? seg[3 * l + 2] - q : per_unit;
                ++u;
            }
        }
    }
    const int64_t buf_len = bs > BLOCK ? bs : BLOCK;
#pragma omp parallel num_threads(x->threads)
    {
        /* Ten buffers, each 80 floats past a multiple of 4 KiB from the others (buffers
         * 4 KiB apart make loads wait on unrelated stores: 4K aliasing). */
        const int64_t stride = buf_len + 80;
        float *buf = (float *)malloc((size_t)stride * 10 * sizeof(float));
        float *gbuf = buf, *abuf = buf + stride, *vbuf = buf + 2 * stride;
        float *mbuf = buf + 3 * stride, *nabuf = buf + 4 * stride, *nvbuf = buf + 5 * stride;
        float *pbuf = buf + 6 * stride, *hbuf = buf + 7 * stride, *tmp = buf + 8 * stride;
        float *wbuf = buf + 9 * stride; /* a split master, joined */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < n_units; ++u) {
            const int64_t l = units[3 * u], q0 = units[3 * u + 1], nq = units[3 * u + 2];
            const int64_t grp = l / per_group;
            const AdamHyper *h = &hs[grp];
            const int gd = x->gdt[l], pd = x->pdt[l], gs = dt_size(gd), ps = dt_size(pd);
            float *const m = x->m[l], *const mo = x->mo[l];
            const int p_is_master = x->po[l] == (void *)mo;
            const int donated = mo == m;
            const int split = x->split, ms = split ? 2 : 4;
            const int in_place = donated && !split; /* the new master written where it is */
            const int st_a = x->sdt[0][l], st_v = n_states > 1 ? x->sdt[1][l] : ST_F32;
            const int bytes_a = st_a == ST_F32 ? 4 : (st_a == ST_E4M3 ? 1 : 2);
            const int bytes_v = st_v == ST_F32 ? 4 : (st_v == ST_E4M3 ? 1 : 2);
            const int64_t len = seg[3 * l], width = seg[3 * l + 1];
            const int64_t per_row = (len + width - 1) / width;
            const int apply = x->apply[grp];
            uint32_t salt_a = 0, salt_v = 0;
            if (sr && apply) {
                const int64_t id = x->salt_ids[l % (x->n_leaves / x->n_members)];
                salt_a = sr_salt(x->counts[grp], 0, id);
                salt_v = sr_salt(x->counts[grp], 1, id);
            }
            for (int64_t q = q0; q < q0 + nq; ++q) {
                const int64_t row = q / per_row, col = (q % per_row) * width;
                const int64_t s = row * len + col, n = len - col < width ? len - col : width;
                char *po_s = (char *)x->po[l] + s * ps;
                if (!apply) {
                    /* A skipped step: the new state is the old one, bit for bit. */
                    if (!donated) {
                        memcpy((char *)mo + s * ms, (const char *)m + s * ms, (size_t)n * ms);
                        memcpy((char *)x->so[0][l] + s * bytes_a,
                               (const char *)x->s[0][l] + s * bytes_a, (size_t)n * bytes_a);
                        if (n_states > 1)
                            memcpy((char *)x->so[1][l] + s * bytes_v,
                                   (const char *)x->s[1][l] + s * bytes_v, (size_t)n * bytes_v);
                        if (st_a == ST_E4M3) x->sco[0][l][q] = x->sc[0][l][q];
                        if (n_states > 1 && st_v == ST_E4M3) x->sco[1][l][q] = x->sc[1][l][q];
                        if (!p_is_master)
                            memcpy(po_s, (const char *)x->p[l] + s * ps, (size_t)(n * ps));
                    }
                    continue;
                }
                to_f32((const char *)x->g[l] + s * gs, gbuf, n, gd);
                const float *m_in = m + s;
                void *mo_s = (char *)mo + s * ms;
                if (split) { /* every read of the segment before its writes */
                    join_master((const uint16_t *)x->p[l] + s, (const int16_t *)(void *)m + s,
                                wbuf, n);
                    m_in = wbuf;
                }
                if (kind == STORED_ADAM && st_a == ST_BF16 && st_v == ST_BF16) { /* one loop */
                    float *m_to = in_place ? mo + s : mbuf;
                    adam_bf16_dispatch(h, gbuf, m_in, (const uint16_t *)x->s[0][l] + s,
                                       (const uint16_t *)x->s[1][l] + s, m_to,
                                       (uint16_t *)x->so[0][l] + s, (uint16_t *)x->so[1][l] + s,
                                       pbuf, n, sr, salt_a, salt_v);
                    finish_segment(mo_s, mbuf, donated, po_s, pbuf, hbuf, p_is_master, pd, ps, split, n);
                    continue;
                }
                float *m_to = in_place ? mo + s : mbuf; /* in place: each element read first */
                if (kind != STORED_ADAM) {
                    decode_moment(st_a, x->s[0][l], st_a == ST_E4M3 ? &x->sc[0][l][q] : NULL,
                                  0, abuf, s, n);
                    /* restrict blocks: every output a buffer of its own */
                    if (kind == STORED_LION)
                        lion_dispatch(&hl[grp], gbuf, m_in, abuf, mbuf, nabuf, pbuf, n);
                    else
                        sgd_dispatch(&hg[grp], gbuf, m_in, abuf, mbuf, nabuf, pbuf, n);
                    if (in_place) memcpy(m_to, mbuf, (size_t)n * 4);
                } else if (st_a == ST_E4M3 && st_v == ST_E4M3 && x->root) { /* decoded inline */
                    float peaks[2] = {0.0f, 0.0f};
                    adam_e4m3_dispatch(h, gbuf, m_in, (const uint8_t *)x->s[0][l] + s,
                                       (const uint8_t *)x->s[1][l] + s, x->sc[0][l][q],
                                       x->sc[1][l][q], m_to, nabuf, nvbuf,
                                       p_is_master ? m_to : pbuf, peaks, n);
                    encode_block(nabuf, peaks[0], (uint8_t *)x->so[0][l] + s, &x->sco[0][l][q],
                                 0, sr, salt_a, n);
                    encode_block(nvbuf, peaks[1], (uint8_t *)x->so[1][l] + s, &x->sco[1][l][q],
                                 1, sr, salt_v, n);
                    finish_segment(mo_s, mbuf, donated, po_s, pbuf, hbuf, p_is_master, pd, ps, split, n);
                    continue;
                } else {
                    decode_moment(st_a, x->s[0][l], st_a == ST_E4M3 ? &x->sc[0][l][q] : NULL,
                                  0, abuf, s, n);
                    decode_moment(st_v, x->s[1][l], st_v == ST_E4M3 ? &x->sc[1][l][q] : NULL,
                                  x->root, vbuf, s, n);
                    adam_dispatch(h, gbuf, m_in, abuf, vbuf, mbuf, nabuf, nvbuf, pbuf, n);
                    if (in_place) memcpy(m_to, mbuf, (size_t)n * 4);
                }
                encode_moment(st_a, nabuf, x->so[0][l], st_a == ST_E4M3 ? &x->sco[0][l][q] : NULL,
                              0, sr, salt_a, tmp, s, n);
                if (n_states > 1)
                    encode_moment(st_v, nvbuf, x->so[1][l],
                                  st_v == ST_E4M3 ? &x->sco[1][l][q] : NULL, x->root, sr, salt_v,
                                  tmp, s, n);
                finish_segment(mo_s, mbuf, donated, po_s, pbuf, hbuf, p_is_master, pd, ps, split, n);
            }
        }
        stream_fence(); /* each thread orders its own streaming stores */
        free(buf);
    }
    free(units);
    free(seg);
    free(hs);
    free(hl);
    free(hg);
}

static void ff_adam_stored_step(const ff_step_args *x) { stored_step(x, STORED_ADAM); }
static void ff_lion_stored_step(const ff_step_args *x) { stored_step(x, STORED_LION); }
static void ff_sgd_stored_step(const ff_step_args *x) { stored_step(x, STORED_SGD); }

/* ------------------------------------------------------------------------ */
/* The steps of fused_step.h's convention, by name.                          */
/* ------------------------------------------------------------------------ */

/* Each step with the number of state lists it takes (at least, at most) and of its
 * hyperparameters, which the C++ op that calls it checks first (-1: the stored steps,
 * whose op checks its arguments itself). */
static const struct {
    const char *name;
    ff_step_fn fn;
    int32_t min_states, max_states, n_hyper;
} STEPS[] = {
    {"lion", ff_lion_step, 1, 1, 5},
    {"rmsprop", ff_rmsprop_step, 1, 2, 5},
    {"adam_stored", ff_adam_stored_step, -1, -1, -1},
    {"lion_stored", ff_lion_stored_step, -1, -1, -1},
    {"sgd_stored", ff_sgd_stored_step, -1, -1, -1},
};

ff_step_fn ff_step_entry(const char *name) {
    for (size_t i = 0; i < sizeof(STEPS) / sizeof(STEPS[0]); ++i)
        if (strcmp(STEPS[i].name, name) == 0) return STEPS[i].fn;
    return NULL;
}

int ff_step_arity(const char *name, int32_t *min_states, int32_t *max_states,
                  int32_t *n_hyper) {
    for (size_t i = 0; i < sizeof(STEPS) / sizeof(STEPS[0]); ++i)
        if (strcmp(STEPS[i].name, name) == 0) {
            *min_states = STEPS[i].min_states;
            *max_states = STEPS[i].max_states;
            *n_hyper = STEPS[i].n_hyper;
            return 1;
        }
    return 0;
}

