/* Gradient-compression kernels on plain memory: no Python, no torch.
 *
 * Every array is contiguous; n counts elements. Layouts match spark_dl/compression exactly:
 * sign bits are packed 8 per byte, first element in the most significant bit (bits.pack(x, 1)),
 * buckets are consecutive runs of `bucket` elements with a shorter last one (SignMeans._split),
 * QSGD codes are level + s packed by bits.pack(codes, code_bits).
 * Vectors of at least SDK_PAR_MIN elements are split across sdk_set_threads() threads.
 */
#ifndef SPARK_DL_KERNELS_H
#define SPARK_DL_KERNELS_H

#include <stdint.h>

#define SDK_PAR_MIN (1 << 20)
#define SDK_MAX_THREADS 32

void sdk_set_threads(int n);
int sdk_get_threads(void);
/* "avx2 f16c" or "scalar": which paths this CPU runs. */
const char *sdk_features(void);
/* 1 forces the scalar paths (tests compare them against the SIMD ones). */
void sdk_force_scalar(int on);
/* 1 makes every allocation inside the kernels fail (tests of the out-of-memory paths). */
void sdk_fail_allocations(int on);

/* Kernels that allocate return 0, or -1 when memory ran out. The encoders allocate everything
 * before their first write, so a -1 leaves the residual (and every other output) as it was; the
 * decoders before touching `out`, so an accumulator is never half added to. */

/* 1-bit with means (SignMeans), p = g / div + e (e_in NULL: zero; div 1: p = g + e; g / div is
 * rounded first, as torch's g / world: an averaging all-reduce needs no divided copy of g). Writes
 * means[2 * nb] (positive mean, negative mean per bucket) and bits[ceil(n / 8)]. When e_out is not
 * NULL it receives the new residual p - q(p), q decoded exactly as SignMeans.decompress does (e_out
 * may be e_in), or, with `defer`, p itself: the caller keeps it with q as the next residual,
 * pending, and the encoder makes one pass for any bucket size. `pending` (2 * nb floats: q's (qp,
 * qn) per bucket of the last step) says e_in holds such a deferred residual, e = e_in - q(e_in); it
 * needs `defer` (returns -2 otherwise). Returns -1, having written nothing, when out of memory. */
int sdk_onebit_encode(const float *g, const float *e_in, const float *pending, float *e_out, int defer, int64_t n,
                      int64_t bucket, float *means, uint8_t *bits, float div);
/* out[i] (+)= decoded value: b * (mp - mn) + mn in float32, as SignMeans.decompress. */
int sdk_onebit_decode(const float *means, const uint8_t *bits, int64_t n, int64_t bucket, float *out,
                      int accumulate);

/* Scaled sign (ScaledSign) of p = g / div + e (div as sdk_onebit_encode's), per bucket of `bucket`
 * elements (the last may be shorter; < 1 or > n: one bucket): scales[j] = sum|p| / length over
 * bucket j, and bits (n <= 0: scales[0] = 0). e is e_in (NULL: zero), or, with `pending` set (one
 * (s, -s) pair per bucket), the residual EF-sign deferred: e_in - q(e_in), q = +-s of its bucket,
 * rounded as the torch path's p - D(C(p)). With p_out set (may be e_in), p itself is written there:
 * the caller keeps it with the scales as the next residual, pending, so EF-sign makes one pass.
 * -1: out of memory, nothing written. */
int sdk_scaled_sign_encode(const float *g, const float *e_in, const float *pending, float *p_out, int64_t n,
                           int64_t bucket, uint8_t *bits, float *scales, float div);
/* out[i] (+)= +-scales[bucket of i]; -1: out of memory, nothing written. */
int sdk_scaled_sign_decode(const float *scales, const uint8_t *bits, int64_t n, int64_t bucket, float *out,
                           int accumulate);

/* float32 -> float16 / bfloat16 of x * scale (scale = 1/world divides before the sum), round to
 * nearest even; and back (exact). bf16 NaN becomes the quiet NaN 0x7FC0 (sign kept). */
void sdk_f32_to_f16(const float *x, uint16_t *h, int64_t n, float scale);
void sdk_f16_to_f32(const uint16_t *h, float *x, int64_t n, int accumulate);  /* x (+)= h */
void sdk_f32_to_bf16(const float *x, uint16_t *h, int64_t n, float scale);
void sdk_bf16_to_f32(const uint16_t *h, float *x, int64_t n, int accumulate);

/* QSGD with `levels` = s and buckets of `bucket` elements: norms[nb] = ||v||_2 (max_norm: ||v||_inf),
 * codes floor(s|v_i|/norm + u) clamped to s, signed, + s, packed in code_bits bits. u comes from
 * a counter-based hash of (element index, seed), so results do not depend on threads (see kernels.c).
 * NaN inputs give code s (zero). */
int sdk_qsgd_encode(const float *x, int64_t n, int64_t bucket, int levels, int code_bits, uint64_t seed,
                    int max_norm, float *norms, uint8_t *packed);
/* out[i] (+)= (code_i - s) * (norms[bucket of i] / s), the division in float32 as torch's. */
void sdk_qsgd_decode(const float *norms, const uint8_t *packed, int64_t n, int64_t bucket, int levels,
                     int code_bits, float *out, int accumulate);

/* The k entries of largest |x| (NaN counts as largest; ties broken by lower index): indices
 * and values, in no particular order. Returns 0, or -1 when memory ran out. */
int sdk_topk(const float *x, int64_t n, int64_t k, int64_t *idx, float *val);

/* PowerSGD's output: out = P Q^T, the first numel elements of the rows x cols product
 * (numel <= rows * cols, 1 <= r), P rows x r and Q cols x r row-major. Each element is p0 q0
 * then fma(pk, qk, .) for k ascending, on every path and thread count. Returns 0 or -1. */
int sdk_lowrank_product(const float *p, const float *q, int64_t numel, int64_t rows, int64_t cols, int r,
                        float *out);
int sdk_lowrank_subtract(const float *p, const float *q, int64_t numel, int64_t rows, int64_t cols, int r,
                         float *m);

/* PowerSGD's first pass over an M of numel elements (a rows x cols matrix, numel <= rows * cols,
 * missing elements zero), in place in m:
 *   mode 0: M = scale G;   mode 1: M = fma(scale, G, M);
 *   mode 2: M = fma(scale, G, M - Pe Qe^T), the product rounded as sdk_lowrank_product
 * (Pe rows x r, Qe cols x r: the last round's residual M - P^ Qw^T, kept as M and its factors),
 * then pt[k * rows + i] = sum_j M[i, j] Q[j, k] (P^T, r x rows; Q cols x r), each dot summed
 * in 8 lanes (j % 8) up to the row's last multiple of 8, the lanes added in a fixed tree, the
 * rest by fma in order: the same bits on every path and thread count. Returns 0 or -1 (memory;
 * nothing written). */
int sdk_powersgd_project(const float *g, float scale, float *m, int mode, const float *pe, const float *qe,
                         const float *q, int64_t numel, int64_t rows, int64_t cols, int r, float *pt);
/* qt[k * cols + j] = sum_i P[i, k] M[i, j] (Qw^T = P^T M, r x cols), each sum fma from zero over
 * the rows in order, the same bits on every path and thread count. */
void sdk_powersgd_back(const float *p, const float *m, int64_t numel, int64_t rows, int64_t cols, int r,
                       float *qt);

/* Training feedback's passes (spark_dl/compression/training.py), one pass over memory each, rounded
 * as torch's ops: x / d, then x + c * v as torch.add(x, v, alpha=c) (one fma on CPUs with AVX2 and
 * FMA, as torch's kernels there; a multiply and an add elsewhere).
 * before: out = g / d + c * v (d NULL: g; v NULL: no add); out may be g.
 * after: v_out = r, then r = (r - c * v) * d in place (v NULL: no subtraction; d NULL: no
 * multiply). Returns 1 when every r read was finite, else 0 (r is written either way). */
void sdk_feedback_before(const float *g, const float *d, const float *v, float c, float *out, int64_t n);
int sdk_feedback_after(float *r, const float *v, float c, const float *d, float *v_out, int64_t n);

#endif
