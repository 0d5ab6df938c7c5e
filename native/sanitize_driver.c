/* Runs every kernel of kernels.c on edge sizes, SIMD and scalar, one and two threads, so that
 * native/check_sanitizers.sh can build it with -fsanitize=address,undefined and catch any
 * out-of-bounds access or undefined behaviour. Exact-size heap buffers: ASan sees one byte over.
 * Exit status 0 when every self-check holds. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static int failures = 0;
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "check failed line %d n=%lld: %s\n", __LINE__, (long long)n, #c); failures++; } } while (0)

static void *xalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) { perror("malloc"); exit(2); }
    return p;
}

static void run(int64_t n) {
    float *g = xalloc(n * sizeof(float)), *e = xalloc(n * sizeof(float)), *out = xalloc(n * sizeof(float));
    uint16_t *h = xalloc(n * 2);
    uint64_t st = 0x1234567 + (uint64_t)n;
    for (int64_t i = 0; i < n; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        g[i] = (float)((int32_t)(st >> 32)) / 2147483648.0f;
        e[i] = 0.01f * g[i];
    }
    if (n > 5) { g[1] = NAN; g[2] = INFINITY; g[3] = -INFINITY; g[4] = 0.0f; g[5] = -0.0f; }
    int64_t buckets[] = {1, 7, 8, 1024, n};
    for (int b = 0; b < 5; b++) {
        int64_t B = buckets[b] < 1 ? 1 : buckets[b];
        int64_t nb = n ? (n + B - 1) / B : 0;
        float *means = xalloc(2 * nb * sizeof(float));
        uint8_t *bits = xalloc((n + 7) / 8);
        CHECK(sdk_onebit_encode(g, e, NULL, out, 0, n, B, means, bits, 1.0f) == 0);
        CHECK(sdk_onebit_encode(g, e, NULL, out, 0, n, B, means, bits, 3.0f) == 0);  /* g / 3 + e */
        CHECK(sdk_onebit_encode(g, e, NULL, out, 1, n, B, means, bits, 2.0f) == 0);
        CHECK(sdk_onebit_encode(g, e, NULL, e, 0, n, B, means, bits, 1.0f) == 0);
        CHECK(sdk_onebit_encode(g, NULL, NULL, NULL, 0, n, B, means, bits, 1.0f) == 0);
        CHECK(sdk_onebit_encode(g, e, NULL, out, 1, n, B, means, bits, 1.0f) == 0);   /* deferred: p out */
        CHECK(sdk_onebit_encode(g, out, means, out, 1, n, B, means, bits, 1.0f) == 0);  /* pending q, p in place */
        CHECK(n == 0 || sdk_onebit_encode(g, e, means, e, 0, n, B, means, bits, 1.0f) == -2);
        CHECK(sdk_onebit_decode(means, bits, n, B, out, 0) == 0);
        CHECK(sdk_onebit_decode(means, bits, n, B, out, 1) == 0);
        free(means);
        free(bits);
    }
    uint8_t *bits = xalloc((n + 7) / 8);
    for (int64_t B = 0; B <= n; B = B ? B * 4 : 64) {  /* 0: one scale for the tensor */
        int64_t nb = B ? (n + B - 1) / B : 1;
        float *scales = xalloc((nb > 0 ? nb : 1) * sizeof(float)), *pend = xalloc(2 * (nb > 0 ? nb : 1) * sizeof(float));
        CHECK(sdk_scaled_sign_encode(g, NULL, NULL, NULL, n, B, bits, scales, 1.0f) == 0);
        CHECK(sdk_scaled_sign_encode(g, e, NULL, out, n, B, bits, scales, 1.0f) == 0);
        CHECK(sdk_scaled_sign_encode(g, e, NULL, out, n, B, bits, scales, 3.0f) == 0);
        for (int64_t j = 0; j < nb; j++) { pend[2 * j] = scales[j]; pend[2 * j + 1] = -scales[j]; }
        CHECK(sdk_scaled_sign_encode(g, e, pend, e, n, B, bits, scales, 1.0f) == 0);  /* deferred, p in place */
        CHECK(sdk_scaled_sign_decode(scales, bits, n, B, out, 1) == 0);
        free(scales);
        free(pend);
        if (!B && n < 64) break;
    }
    free(bits);

    sdk_f32_to_f16(g, h, n, 0.5f);
    sdk_f16_to_f32(h, out, n, 0);
    sdk_f16_to_f32(h, out, n, 1);
    sdk_f32_to_bf16(g, h, n, 1.0f);
    sdk_bf16_to_f32(h, out, n, 1);
    sdk_bf16_to_f32(h, out, n, 0);
    for (int64_t i = 6; i < n; i++) CHECK(fabsf(out[i] - g[i]) <= fabsf(g[i]) * 0.004f);

    /* training feedback on finite values (e as d, all > 0); g's NaN and inf are flagged */
    float *v = xalloc(n * sizeof(float)), *r = xalloc(n * sizeof(float));
    for (int64_t i = 0; i < n; i++) { e[i] = 0.5f + (float)(i % 3); v[i] = 0.25f * (float)(i % 7) - 0.5f; }
    sdk_feedback_before(v, NULL, NULL, 0.0f, r, n);
    CHECK(n == 0 || memcmp(r, v, n * sizeof(float)) == 0);
    sdk_feedback_before(v, e, v, 0.45f, r, n);
    sdk_feedback_before(r, e, NULL, 0.0f, r, n);  /* in place */
    CHECK(sdk_feedback_after(r, v, 0.9f, e, out, n) == 1);
    CHECK(sdk_feedback_after(r, NULL, 0.9f, NULL, out, n) == 1 && (n == 0 || memcmp(r, out, n * sizeof(float)) == 0));
    memcpy(r, g, n * sizeof(float));
    CHECK(sdk_feedback_after(r, v, 0.9f, NULL, out, n) == (n > 5 ? 0 : 1));
    free(v);
    free(r);

    for (int bitsw = 1; bitsw <= 8; bitsw++) {
        int levels = ((1 << bitsw) - 1) / 2 > 0 ? ((1 << bitsw) - 1) / 2 : 1;
        if (2 * levels + 1 > (1 << bitsw)) continue;
        int64_t B = 512 < n ? 512 : (n ? n : 1);
        int64_t nb = n ? (n + B - 1) / B : 0;
        int64_t nbytes = 8 % bitsw == 0 ? (n + 8 / bitsw - 1) / (8 / bitsw) : bitsw * ((n + 7) / 8);
        float *norms = xalloc(nb * sizeof(float));
        uint8_t *packed = xalloc(nbytes);
        CHECK(sdk_qsgd_encode(g, n, B, levels, bitsw, 42, bitsw & 1, norms, packed) == 0);
        for (int64_t j = 0; j < nb; j++) norms[j] /= (float)levels;
        sdk_qsgd_decode(norms, packed, n, B, levels, bitsw, out, 0);
        free(norms);
        free(packed);
    }

    int64_t ks[] = {0, 1, n / 100, n / 2, n};
    for (int j = 0; j < 5; j++) {
        int64_t k = ks[j] < n ? ks[j] : n;
        int64_t *idx = xalloc(k * sizeof(int64_t));
        float *val = xalloc(k * sizeof(float));
        CHECK(sdk_topk(g, n, k, idx, val) == 0);
        for (int64_t i = 0; i < k; i++) CHECK(idx[i] >= 0 && idx[i] < n);
        free(idx);
        free(val);
    }
    /* PowerSGD's output as a rows x cols product of n elements (padding rows not stored) */
    if (n > 0) {
        int64_t rows = 1;
        while (rows * rows < n) rows++;
        int64_t cols = (n + rows - 1) / rows;
        for (int r = 1; r <= 5; r += 3) {
            float *p = xalloc(rows * r * sizeof(float)), *q = xalloc(cols * r * sizeof(float));
            for (int64_t i = 0; i < rows * r; i++) p[i] = g[i % n];
            for (int64_t i = 0; i < cols * r; i++) q[i] = e[i % n];
            CHECK(sdk_lowrank_product(p, q, n, rows, cols, r, out) == 0);
            float *m = xalloc(rows * cols * sizeof(float));
            for (int64_t i = 0; i < rows * cols; i++) m[i] = g[i % n];
            CHECK(sdk_lowrank_subtract(p, q, rows * cols, rows, cols, r, m) == 0);
            /* PowerSGD's passes over an M of n elements (the last row may be short) */
            float *pt = xalloc(r * rows * sizeof(float)), *qt = xalloc(r * cols * sizeof(float));
            for (int mode = 0; mode < 3; mode++) {
                CHECK(sdk_powersgd_project(g, 0.5f, out, mode, p, q, q, n, rows, cols, r, pt) == 0);
                sdk_powersgd_back(p, out, n, rows, cols, r, qt);
            }
            free(pt);
            free(qt);
            free(m);
            free(p);
            free(q);
        }
    }
    free(g); free(e); free(out); free(h);
}

/* With every allocation failing, the kernels that allocate report -1 and leave their in/out
 * buffers (residual, accumulator) untouched. */
static void oom(int64_t n) {
    float *g = xalloc(n * sizeof(float)), *e = xalloc(n * sizeof(float)), *e0 = xalloc(n * sizeof(float));
    float *means = xalloc(2 * n * sizeof(float)), *norms = xalloc(n * sizeof(float)), scale;
    uint8_t *bits = xalloc((n + 7) / 8), *packed = xalloc(n);
    int64_t *idx = xalloc(n * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) { g[i] = (float)(i % 13) - 6.0f; e[i] = e0[i] = 0.25f * (float)(i % 5); }
    memset(bits, 0, (n + 7) / 8);
    sdk_fail_allocations(1);
    CHECK(sdk_onebit_encode(g, e, NULL, e, 0, n, 1024, means, bits, 1.0f) == -1);       /* fused: one pass */
    CHECK(sdk_onebit_encode(g, e, NULL, e, 0, n, 100000, means, bits, 1.0f) == -1);     /* two passes */
    CHECK(sdk_onebit_encode(g, e, means, e, 1, n, 100000, means, bits, 1.0f) == -1);    /* deferred */
    float pend[2] = {0.5f, -0.5f};
    CHECK(sdk_scaled_sign_encode(g, e, pend, e, n, 0, bits, &scale, 1.0f) == -1);
    CHECK(sdk_scaled_sign_decode(means, bits, n, 64, e, 1) == -1);
    CHECK(sdk_onebit_decode(means, bits, n, 1024, e, 1) == -1);
    CHECK(sdk_qsgd_encode(g, n, 100000, 7, 4, 1, 0, norms, packed) == -1);
    CHECK(sdk_topk(g, n, n / 10 + 1, idx, norms) == -1);
    CHECK(sdk_topk(g, n, n / 100 + 1, idx, norms) == -1);  /* the sampled threshold's path */
    CHECK(sdk_lowrank_product(g, e0, n, 1, n, 1, norms) == -1);
    CHECK(sdk_lowrank_subtract(g, e0, n, 1, n, 1, e) == -1);  /* M (here e) left as it was */
    CHECK(sdk_powersgd_project(g, 1.0f, e, 2, g, e0, e0, n, 1, n, 1, norms) == -1);
    sdk_fail_allocations(0);
    CHECK(memcmp(e, e0, n * sizeof(float)) == 0);
    free(g); free(e); free(e0); free(means); free(norms); free(bits); free(packed); free(idx);
}

int main(void) {
    int64_t sizes[] = {0, 1, 7, 8, 9, 15, 16, 17, 1023, 1025, 65537, SDK_PAR_MIN + 9};
    for (int scalar = 0; scalar < 2; scalar++) {
        sdk_force_scalar(scalar);
        int threads[] = {1, 2, 5};  /* 5: more shares than this machine's cores */
        for (int ti = 0; ti < 3; ti++) {
            sdk_set_threads(threads[ti]);
            for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) run(sizes[i]);
        }
    }
    sdk_force_scalar(0);
    oom(300001);
    oom(SDK_PAR_MIN + 9);
    printf("%s: %d failed checks (%s)\n", failures ? "FAIL" : "ok", failures, sdk_features());
    return failures != 0;
}
