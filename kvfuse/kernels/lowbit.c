/* Products of float rows with weights held in 4- or 8-bit groups (kvfuse.lowbit).
 *
 * A weight (N, K) is integers q with a float scale s and optional offset o per group of G inputs
 * (G = 32, or 16 for 8-bit): w = s * q + o, exactly a GGUF block's dequantisation.
 *   8-bit: q signed int8, row-major (N, K).
 *   4-bit: q in 0..15, two to a byte: in each run of 32 bytes (64 weights), byte j holds weight j in its
 *          low nibble and weight 32 + j in its high one; a format's zero point (Q4_0's 8) is folded into
 *          the offset the kernel is given (o - 8 s), while `lb_dequantize` subtracts it exactly.
 * Each input row is rounded to int8 per block of 32 (its own scale a = max|x| / 127), as llama.cpp's
 * Q8_0 activations; every group's integer dot product is exact (int32), then scaled by s * a in
 * float32. The offset adds o * a * sum(xq) per group. A row's result depends on that row alone, in the
 * same order of operations whatever the number of rows or threads: batched and lone products are equal.
 *
 * Paths by the compiler flags this file is built with (kvfuse.lowbit picks them from /proc/cpuinfo):
 * AVX2 (u8 x s8 pairs with vpmaddubsw, whose int16 sums cannot saturate here: |q| <= 128, |xq| <= 127
 * after the sign trick), and AVX-512 VNNI or AVX-VNNI (vpdpbusd, summed in int32), both 256 bits wide.
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#elif defined(__AVXVNNI__)
#define DOT(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (s))
#else
#define DOT(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#endif

#define QBLOCK 32
#define MAX_TILE 4

int lb_version(void) { return 1; }

/* rows x (R, K) -> xq (R, K) int8, a (R, K/32) their scales, gs (R, K/16 + K/32): each 16 inputs'
 * a * sum(xq), then each 32's */
void lb_quantize(const float *x, int64_t R, int64_t K, int8_t *xq, float *a, float *gs) {
    const int64_t per_row = K / 16 + K / 32;
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * K;
        for (int64_t b = 0; b < K / QBLOCK; b++) {
            const float *xb = xr + b * QBLOCK;
            float amax = 0.0f;
            for (int i = 0; i < QBLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
            float scale = amax / 127.0f;
            float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            int8_t *qb = xq + r * K + b * QBLOCK;
            int whole = 0;
            for (int g = 0; g < 2; g++) {
                int sum = 0;
                for (int i = g * 16; i < (g + 1) * 16; i++) {
                    int v = (int)nearbyintf(xb[i] * inv);
                    v = v > 127 ? 127 : (v < -127 ? -127 : v);
                    qb[i] = (int8_t)v;
                    sum += v;
                }
                gs[r * per_row + b * 2 + g] = scale * (float)sum;
                whole += sum;
            }
            gs[r * per_row + K / 16 + b] = scale * (float)whole;
            a[r * (K / QBLOCK) + b] = scale;
        }
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the scale of each int32 lane of a 32-weight run starting at group g (G = 32: one; G = 16: two) */
static inline __m256 lane_scales(const float *s, int64_t g, int G, float a) {
    if (G == 32) return _mm256_set1_ps(s[g] * a);
    return _mm256_setr_m128(_mm_set1_ps(s[g] * a), _mm_set1_ps(s[g + 1] * a));
}

/* one output column n for rows r0 .. r0 + T of the tile */
static inline __attribute__((always_inline)) void column(
    const uint8_t *w, int bits, int G, const float *scale, const float *offset, int64_t n, int64_t K,
    const int8_t *xq, const float *a, const float *gs, int64_t r0, const int T, float *out, int64_t ldo) {
    __m256 acc[MAX_TILE];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    const int64_t groups = K / G;
    const float *s = scale + n * groups;
    if (bits == 8) {
        const int8_t *q = (const int8_t *)w + n * K;
        for (int64_t k = 0; k < K; k += 32) {
            __m256i qv = _mm256_loadu_si256((const __m256i *)(q + k));
            __m256i u = _mm256_sign_epi8(qv, qv); /* |q|, 128 for -128 read as unsigned */
            for (int t = 0; t < T; t++) {
                const int64_t r = r0 + t;
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + k));
                __m256i d = DOT(u, _mm256_sign_epi8(xv, qv));
                __m256 sv = lane_scales(s, k / G, G, a[r * (K / QBLOCK) + k / QBLOCK]);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sv, acc[t]);
            }
        }
    } else {
        const uint8_t *q = w + n * (K / 2);
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int64_t k = 0; k < K; k += 64) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(q + k / 2));
            __m256i lo = _mm256_and_si256(v, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int t = 0; t < T; t++) {
                const int64_t r = r0 + t;
                const int8_t *xr = xq + r * K + k;
                __m256i d0 = DOT(lo, _mm256_loadu_si256((const __m256i *)xr));
                __m256i d1 = DOT(hi, _mm256_loadu_si256((const __m256i *)(xr + 32)));
                const float *ar = a + r * (K / QBLOCK) + k / QBLOCK;
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(s[k / 32] * ar[0]), acc[t]);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(s[k / 32 + 1] * ar[1]), acc[t]);
            }
        }
    }
    for (int t = 0; t < T; t++) {
        const int64_t r = r0 + t;
        float y = hsum(acc[t]);
        if (offset) { /* the offset of each group times its inputs' a * sum(xq) (gs, as lb_quantize) */
            const float *o = offset + n * groups, *g = gs + r * (K / 16 + K / 32) + (G == 16 ? 0 : K / 16);
            __m256 oacc = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= groups; i += 8)
                oacc = _mm256_fmadd_ps(_mm256_loadu_ps(o + i), _mm256_loadu_ps(g + i), oacc);
            float sum = hsum(oacc);
            for (; i < groups; i++) sum += o[i] * g[i];
            y += sum;
        }
        out[r * ldo + n] = y;
    }
}

/* out (R, N) = the quantised rows (lb_quantize) times the weight (N, K), transposed; row r of out starts at
 * out + r * ldo (a column slice of a wider output). K is a multiple of 64 (4-bit) or 32 (8-bit). */
void lb_matmul(int64_t R, int64_t K, const int8_t *xq, const float *a, const float *gs, const uint8_t *w, int bits,
               int G, const float *scale, const float *offset, int64_t N, float *out, int64_t ldo) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        int64_t r0 = 0;
        for (; r0 + 4 <= R; r0 += 4) column(w, bits, G, scale, offset, n, K, xq, a, gs, r0, 4, out, ldo);
        switch (R - r0) {
        case 3: column(w, bits, G, scale, offset, n, K, xq, a, gs, r0, 3, out, ldo); break;
        case 2: column(w, bits, G, scale, offset, n, K, xq, a, gs, r0, 2, out, ldo); break;
        case 1: column(w, bits, G, scale, offset, n, K, xq, a, gs, r0, 1, out, ldo); break;
        default: break;
        }
    }
}

/* row n of the float32 weight: s * (q - zero) + o per group (exactly as a GGUF's dequantisation; `offset`
 * here is the format's own, none for Q4_0, whose zero is 8, not the kernel's) */
static void dequantize_row(const uint8_t *w, int bits, int G, int zero, const float *scale, const float *offset,
                           int64_t K, int64_t n, float *o) {
    const int64_t groups = K / G;
    const float *s = scale + n * groups;
    const float *off = offset ? offset + n * groups : 0;
    if (bits == 8) {
        const int8_t *q = (const int8_t *)w + n * K;
        for (int64_t g = 0; g < groups; g++)
            for (int i = 0; i < G; i++) o[g * G + i] = (float)q[g * G + i] * s[g];
    } else {
        const uint8_t *q = w + n * (K / 2);
        for (int64_t run = 0; run < K / 64; run++) {
            const uint8_t *b = q + run * 32;
            const float s0 = s[2 * run], s1 = s[2 * run + 1];
            for (int j = 0; j < 32; j++) {
                o[run * 64 + j] = (float)((int)(b[j] & 0x0F) - zero) * s0;
                o[run * 64 + 32 + j] = (float)((int)(b[j] >> 4) - zero) * s1;
            }
        }
    }
    if (off)
        for (int64_t g = 0; g < groups; g++)
            for (int i = 0; i < G; i++) o[g * G + i] = o[g * G + i] + off[g];
}

/* rows n0 .. n1 of the float32 weight into out ((n1 - n0), K) */
void lb_dequantize(const uint8_t *w, int bits, int G, int zero, const float *scale, const float *offset,
                   int64_t N, int64_t K, int64_t n0, int64_t n1, float *out) {
    (void)N;
#pragma omp parallel for schedule(static)
    for (int64_t n = n0; n < n1; n++) dequantize_row(w, bits, G, zero, scale, offset, K, n, out + (n - n0) * K);
}

/* the same rows rounded to bfloat16 (to nearest, ties to even) into out ((n1 - n0), K) uint16: a
 * prefill's products on CPUs with bfloat16 hardware */
void lb_dequantize_bf16(const uint8_t *w, int bits, int G, int zero, const float *scale, const float *offset,
                        int64_t N, int64_t K, int64_t n0, int64_t n1, uint16_t *out, float *scratch) {
    (void)N;
#pragma omp parallel for schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        float *row = scratch + (int64_t)omp_get_thread_num() * K;
        dequantize_row(w, bits, G, zero, scale, offset, K, n, row);
        uint16_t *o = out + (n - n0) * K;
        for (int64_t k = 0; k < K; k++) {
            uint32_t b;
            memcpy(&b, &row[k], 4);
            b += 0x7FFFu + ((b >> 16) & 1u);
            o[k] = (uint16_t)(b >> 16);
        }
    }
}
