/* Gradient-compression kernels: see kernels.h for the contracts.
 *
 * Built with -O3 -ffp-contract=off for baseline x86-64: float results must round exactly as
 * torch's separate multiply and add do. AVX2/F16C loops are compiled per function with
 * __attribute__((target)) and chosen at run time, so one binary runs on any x86-64 CPU.
 */
#include "kernels.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SDK_X86 1
#define AVX2 __attribute__((target("avx2")))
#define AVX2F16C __attribute__((target("avx2,f16c")))
#define AVX2FMA __attribute__((target("avx2,fma")))
#else
#define SDK_X86 0
#endif

static int g_threads = 2;
static int g_scalar = 0;
static int g_fail_alloc = 0;  /* tests: every allocation in the kernels fails */

void sdk_fail_allocations(int on) { g_fail_alloc = on; }
static void *k_malloc(size_t n) { return g_fail_alloc ? NULL : malloc(n); }
static void *k_calloc(size_t n, size_t size) { return g_fail_alloc ? NULL : calloc(n, size); }

/* Scratch kept per calling thread and reused by its next call. The sign encoders' per-bucket sums
 * are 32 bytes a bucket (4.7 MB per array for 9.47M elements in 64-element buckets): allocated and
 * freed every call, glibc's defaults hand such blocks back to the kernel at free, so each call
 * paid its page faults again (14.9 ms against 4.2 ms for that encode, in a process without the
 * allocator settings of spark-dl's ranks, spark_dl/rank/allocator.py). A block above SCRATCH_KEEP
 * is not kept: a thread holds at most SCRATCH_SLOTS of them, freed when it exits. */
enum { SCRATCH_SUMS, SCRATCH_TOTALS, SCRATCH_PAIRS, SCRATCH_SLOTS };
#define SCRATCH_KEEP ((size_t)64 << 20)
typedef struct { void *p[SCRATCH_SLOTS]; size_t cap[SCRATCH_SLOTS]; } scratch_set;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_ok;

static void scratch_release(void *v) {
    scratch_set *s = (scratch_set *)v;
    for (int i = 0; i < SCRATCH_SLOTS; i++) free(s->p[i]);
    free(s);
}

static void scratch_init(void) { scratch_ok = pthread_key_create(&scratch_key, scratch_release) == 0; }

/* n bytes for this thread's use until its next call with the same slot (*owned = 0), or, above
 * SCRATCH_KEEP or without thread-specific data, a block the caller frees (*owned = 1). NULL when
 * out of memory. */
static void *scratch(int slot, size_t n, int *owned) {
    *owned = 1;
    if (g_fail_alloc) return NULL;
    if (n == 0) n = 1;
    pthread_once(&scratch_once, scratch_init);
    if (!scratch_ok || n > SCRATCH_KEEP) return malloc(n);
    scratch_set *s = (scratch_set *)pthread_getspecific(scratch_key);
    if (!s) {
        s = (scratch_set *)calloc(1, sizeof *s);
        if (s && pthread_setspecific(scratch_key, s) != 0) { free(s); s = NULL; }
        if (!s) return malloc(n);
    }
    if (s->cap[slot] < n) {
        void *p = malloc(n);
        if (!p) return NULL;
        free(s->p[slot]);
        s->p[slot] = p;
        s->cap[slot] = n;
    }
    *owned = 0;
    return s->p[slot];
}

static void scratch_done(void *p, int owned) { if (owned) free(p); }

void sdk_set_threads(int n) { g_threads = n < 1 ? 1 : (n > SDK_MAX_THREADS ? SDK_MAX_THREADS : n); }
int sdk_get_threads(void) { return g_threads; }
void sdk_force_scalar(int on) { g_scalar = on; }

static int has_avx2(void) {
#if SDK_X86
    return !g_scalar && __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static int has_f16c(void) {
#if SDK_X86
    return has_avx2() && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

static int has_fma(void) {
#if SDK_X86
    return has_avx2() && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

const char *sdk_features(void) {
    if (has_f16c()) return "avx2 f16c";
    return has_avx2() ? "avx2" : "scalar";
}

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---- threads ------------------------------------------------------------------------------ */

typedef void (*task_fn)(void *arg, int t, int nt);
typedef struct { task_fn fn; void *arg; int t, nt; } task;

static void *task_main(void *p) {
    task *k = (task *)p;
    k->fn(k->arg, k->t, k->nt);
    return NULL;
}

static int threads_for(int64_t n) { return n >= SDK_PAR_MIN ? g_threads : 1; }

/* Runs fn(arg, t, nt) for t < nt on fresh threads, t = 0 on the calling thread. A thread that
 * cannot be started runs inline: slower, same result. */
static void spawn_parallel(int nt, task_fn fn, void *arg) {
    pthread_t th[SDK_MAX_THREADS];
    task tasks[SDK_MAX_THREADS];
    int started[SDK_MAX_THREADS] = {0};
    for (int t = 1; t < nt; t++) {
        tasks[t] = (task){fn, arg, t, nt};
        started[t] = pthread_create(&th[t], NULL, task_main, &tasks[t]) == 0;
    }
    fn(arg, 0, nt);
    for (int t = 1; t < nt; t++) {
        if (started[t]) pthread_join(th[t], NULL);
        else fn(arg, t, nt);
    }
}

/* A pool of parked worker threads, started on first use and kept: starting a thread costs tens of
 * microseconds, as much as a whole kernel on a 1M-element vector split 16 ways. One job at a
 * time: a call that finds the pool busy (another Python thread, the GIL being released) starts
 * its own threads instead. A forked child (Spark's Python workers fork) has none of the parent's
 * threads: pthread_atfork empties the pool there, and the child starts its own. */
static struct {
    pthread_mutex_t lock, busy;
    pthread_cond_t wake, done;
    int workers;         /* parked threads: task numbers 1..workers */
    unsigned long job;   /* bumped for each job */
    task_fn fn;
    void *arg;
    int nt, running;     /* the job's task count; workers not yet through it */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, 0, 0};
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.busy, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.workers = 0;
    pool.running = 0;
}

static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

typedef struct { int t; unsigned long seen; } worker_args;

static void *pool_worker(void *p) {
    worker_args w = *(worker_args *)p;
    free(p);
    for (;;) {
        pthread_mutex_lock(&pool.lock);
        while (pool.job == w.seen) pthread_cond_wait(&pool.wake, &pool.lock);
        w.seen = pool.job;
        task_fn fn = pool.fn;
        void *arg = pool.arg;
        int nt = pool.nt;
        pthread_mutex_unlock(&pool.lock);
        if (w.t < nt) fn(arg, w.t, nt);
        pthread_mutex_lock(&pool.lock);
        if (--pool.running == 0) pthread_cond_signal(&pool.done);
        pthread_mutex_unlock(&pool.lock);
    }
    return NULL;
}

/* Runs fn(arg, t, nt) for t < nt, t = 0 on the calling thread. */
static void parallel(int nt, task_fn fn, void *arg) {
    if (nt <= 1) {
        fn(arg, 0, 1);
        return;
    }
    pthread_once(&pool_once, pool_init);
    if (pthread_mutex_trylock(&pool.busy) != 0) {
        spawn_parallel(nt, fn, arg);
        return;
    }
    while (pool.workers < nt - 1) {  /* workers start parked before this job is posted */
        worker_args *w = (worker_args *)malloc(sizeof *w);
        pthread_t th;
        if (!w) break;
        *w = (worker_args){pool.workers + 1, pool.job};
        if (pthread_create(&th, NULL, pool_worker, w) != 0) {
            free(w);
            break;
        }
        pthread_detach(th);
        pool.workers++;
    }
    pthread_mutex_lock(&pool.lock);
    pool.fn = fn;
    pool.arg = arg;
    pool.nt = nt;
    pool.running = pool.workers;
    pool.job++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(arg, 0, nt);
    for (int t = pool.workers + 1; t < nt; t++) fn(arg, t, nt);  /* threads that could not start */
    pthread_mutex_lock(&pool.lock);
    while (pool.running > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.busy);
}

/* Thread t's share [*a, *b) of [0, n), cut at multiples of `align`. */
static void share(int64_t n, int t, int nt, int64_t align, int64_t *a, int64_t *b) {
    int64_t chunk = (n + nt - 1) / nt;
    chunk = (chunk + align - 1) / align * align;
    *a = t * chunk < n ? t * chunk : n;
    *b = *a + chunk < n ? *a + chunk : n;
}

/* MSB-first sign byte from an AVX movemask (bit j = element j). */
static uint8_t rev8[256];
static pthread_once_t rev_once = PTHREAD_ONCE_INIT;
static void rev_init(void) {
    for (int i = 0; i < 256; i++) {
        int r = 0;
        for (int j = 0; j < 8; j++) r |= ((i >> j) & 1) << (7 - j);
        rev8[i] = (uint8_t)r;
    }
}

/* ---- deterministic sums ---------------------------------------------------------------------
 *
 * Every sum the kernels report (1-bit means, the EF-sign scale, QSGD norms) is defined so that
 * the torch path (spark_dl/compression/sums.py) computes the same double, bit for bit, whatever
 * the thread count or SIMD path:
 *   - a bucket is cut into pieces at multiples of RBLOCK elements (global indices);
 *   - a piece is summed in 8 double lanes, element i into lane (i - piece start) % 8, each lane
 *     from 0.0 in index order, then the lanes from 0.0 in lane order;
 *   - a bucket's sum is its pieces' sums added from 0.0 in index order.
 * Floats convert to double exactly (squares too), so only the order of the additions matters,
 * and that order is fixed above. Threads cut their shares at multiples of RBLOCK. */
#define RBLOCK 65536

static double lanes8(const double *a) {
    double s = 0.0;
    for (int l = 0; l < 8; l++) s += a[l];
    return s;
}

/* ---- 1-bit: pass 1 (signs + bucket sums) ---------------------------------------------------- */

typedef struct { double pos, all, ab; int64_t npos; } bsum;

/* The two values q(p) takes in a bucket: for p >= 0 and for p < 0. */
typedef struct { float qp, qn; } qpair;

typedef struct {
    const float *g, *e;
    int64_t n, bucket;
    uint8_t *bits;
    bsum *part[SDK_MAX_THREADS];  /* thread t: sums for buckets a/bucket .. (b-1)/bucket */
    bsum *cont[SDK_MAX_THREADS];  /* pieces of its first bucket when that began in thread t-1 */
    int64_t ncont[SDK_MAX_THREADS];
    int scaled;  /* 1: EF-sign, which needs only the |p| sums */
    float *e_out;  /* fused residual (1-bit, buckets <= RBLOCK): see p1_task */
    const qpair *pend;  /* per bucket: the q of a deferred residual, e = e_in - q(e_in); or NULL */
    float *p_out;       /* deferred residual: receives p (may be e_in), or NULL */
    float div;          /* p = g / div + e (an averaging all-reduce's world size); 1: p = g + e */
    float inv;          /* 1 / div where div is a power of two (x * inv is then x / div exactly), else 0 */
} p1_args;

/* 1 / div for a power of two (the same bits as dividing, for every x), else 0: divide. */
static float exact_inverse(float div) {
    int e;
    return frexpf(div, &e) == 0.5f ? 1.0f / div : 0.0f;
}

/* g / div, rounded as torch's g / world: a multiply by inv where exact_inverse gave one. */
static inline float divided(float g, float div, float inv) { return inv != 0.0f ? g * inv : g / div; }

/* Signs of p = g + e over one piece [lo, hi) or-ed into bits (zeroed by the caller), and the
 * piece's sums of max(p, 0) (NaN kept: torch's clamp keeps it), p and |p|, and its count of
 * p >= 0. Lanes as in the comment above. */
/* Elements [i, hi) of the piece that starts at lo, into its lanes (also the SIMD path's tail). */
static int64_t piece_lanes(const p1_args *A, int64_t lo, int64_t i, int64_t hi, double *P, double *Al,
                           double *Ab) {
    const float *g = A->g, *e = A->e;
    uint8_t *bits = A->bits;
    const qpair q = A->pend ? A->pend[lo / A->bucket] : (qpair){0.0f, 0.0f};  /* a piece lies in one bucket */
    int64_t np = 0;
    for (; i < hi; i++) {
        float ei = 0.0f;
        if (e) {
            ei = e[i];
            /* the residual left pending: e - q(e), rounded as the torch path's p - D(C(p)) */
            if (A->pend) ei = ei - (ei >= 0.0f ? q.qp : q.qn);
        }
        float gi = divided(g[i], A->div, A->inv);
        float p = e ? gi + ei : gi;
        if (A->p_out) A->p_out[i] = p;
        int ge = p >= 0.0f, l = (int)((i - lo) & 7);
        bits[i >> 3] |= (uint8_t)(ge << (7 - (i & 7)));
        P[l] += !(p < 0.0f) ? (double)p : 0.0;
        Al[l] += (double)p;
        Ab[l] += (double)fabsf(p);
        np += ge;
    }
    return np;
}

static void piece_scalar(const p1_args *A, int64_t lo, int64_t hi, bsum *out) {
    double P[8] = {0}, Al[8] = {0}, Ab[8] = {0};
    int64_t np = piece_lanes(A, lo, lo, hi, P, Al, Ab);
    out->pos = lanes8(P); out->all = lanes8(Al); out->ab = lanes8(Ab); out->npos = np;
}

#if SDK_X86
/* The same piece, lo a multiple of 8 (whole sign bytes): lanes 0-3 and 4-7 in two registers. */
AVX2 static void piece_avx2(const p1_args *A, int64_t lo, int64_t hi, bsum *out) {
    const float *g = A->g, *e = A->e;
    float *p_out = A->p_out;
    uint8_t *bits = A->bits;
    const int scaled = A->scaled;
    const __m256 zero = _mm256_setzero_ps();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const qpair q = A->pend ? A->pend[lo / A->bucket] : (qpair){0.0f, 0.0f};
    const __m256 sp = _mm256_set1_ps(q.qp), sn = _mm256_set1_ps(q.qn);
    const int divide = A->div != 1.0f, multiply = A->inv != 0.0f;
    const __m256 dv = _mm256_set1_ps(A->div), iv = _mm256_set1_ps(A->inv);
    __m256d p0 = _mm256_setzero_pd(), p1 = p0, a0 = p0, a1 = p0, b0 = p0, b1 = p0;
    int64_t np = 0, i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 p = _mm256_loadu_ps(g + i);
        if (divide) p = multiply ? _mm256_mul_ps(p, iv) : _mm256_div_ps(p, dv);
        if (e) {
            __m256 ev = _mm256_loadu_ps(e + i);
            if (A->pend) ev = _mm256_sub_ps(ev, _mm256_blendv_ps(sn, sp, _mm256_cmp_ps(ev, zero, _CMP_GE_OQ)));
            p = _mm256_add_ps(p, ev);
        }
        if (p_out) _mm256_storeu_ps(p_out + i, p);
        int m = _mm256_movemask_ps(_mm256_cmp_ps(p, zero, _CMP_GE_OQ));
        bits[i >> 3] = rev8[m];
        np += __builtin_popcount((unsigned)m);
        if (scaled) {  /* EF-sign needs only sum |p|; 1-bit only the other two */
            __m256 ab = _mm256_and_ps(p, absmask);
            b0 = _mm256_add_pd(b0, _mm256_cvtps_pd(_mm256_castps256_ps128(ab)));
            b1 = _mm256_add_pd(b1, _mm256_cvtps_pd(_mm256_extractf128_ps(ab, 1)));
        } else {
            __m256 pos = _mm256_and_ps(p, _mm256_cmp_ps(p, zero, _CMP_NLT_UQ));
            p0 = _mm256_add_pd(p0, _mm256_cvtps_pd(_mm256_castps256_ps128(pos)));
            p1 = _mm256_add_pd(p1, _mm256_cvtps_pd(_mm256_extractf128_ps(pos, 1)));
            a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(p)));
            a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)));
        }
    }
    double P[8], Al[8], Ab[8];
    _mm256_storeu_pd(P, p0); _mm256_storeu_pd(P + 4, p1);
    _mm256_storeu_pd(Al, a0); _mm256_storeu_pd(Al + 4, a1);
    _mm256_storeu_pd(Ab, b0); _mm256_storeu_pd(Ab + 4, b1);
    np += piece_lanes(A, lo, i, hi, P, Al, Ab);  /* the tail continues the lanes */
    out->pos = lanes8(P); out->all = lanes8(Al); out->ab = lanes8(Ab); out->npos = np;
}
#endif

/* The two values q takes in a bucket, rounded as SignMeans.decompress: fl(fl(b * d) + mn). */

static qpair q_of(float mp, float mn) {
    float d = mp - mn;
    qpair q = {1.0f * d + mn, 0.0f * d + mn};
    return q;
}

/* A bucket's (positive mean, negative mean) from its sums, as SignMeans computes them. */
static void means_of(const bsum *s, int64_t len, float *mp, float *mn) {
    int64_t nn = len - s->npos;
    *mp = (float)(s->pos / (double)(s->npos > 0 ? s->npos : 1));
    *mn = (float)((s->all - s->pos) / (double)(nn > 0 ? nn : 1));
}

#define RESIDUAL_LOOP                                                                  \
    for (int64_t i = lo; i < hi; i++) {                                                \
        float gi = divided(g[i], div, inv);                                            \
        float p = e_in ? gi + e_in[i] : gi;                                            \
        e_out[i] = p - (p >= 0.0f ? qp : qn);                                          \
    }

static void resid_scalar(const float *g, const float *e_in, float *e_out, int64_t lo, int64_t hi,
                         float qp, float qn, float div, float inv) { RESIDUAL_LOOP }
#if SDK_X86
AVX2 static void resid_avx2(const float *g, const float *e_in, float *e_out, int64_t lo, int64_t hi,
                            float qp, float qn, float div, float inv) { RESIDUAL_LOOP }
#endif

static void resid_range(const float *g, const float *e_in, float *e_out, int64_t lo, int64_t hi, qpair q,
                        float div, float inv) {
#if SDK_X86
    if (has_avx2()) { resid_avx2(g, e_in, e_out, lo, hi, q.qp, q.qn, div, inv); return; }
#endif
    resid_scalar(g, e_in, e_out, lo, hi, q.qp, q.qn, div, inv);
}

/* With e_out set (1-bit with buckets of at most RBLOCK elements), a bucket that lies whole in
 * this thread's share gets its residual as soon as its sums are complete, while its g and e are
 * still in cache: one pass over memory instead of two. The sums, hence the means, are the ones
 * pass1 assembles; buckets cut by a share boundary get theirs after the join. */
static void p1_task(void *arg, int t, int nt) {
    p1_args *A = (p1_args *)arg;
    int64_t a, b;
    share(A->n, t, nt, RBLOCK, &a, &b);
    A->ncont[t] = 0;
    if (a >= b) return;
    int64_t B = A->bucket, j0 = a / B;
    bsum *s = A->part[t], *cl = A->cont[t];
    int cont = j0 * B < a;
    memset(A->bits + (a >> 3), 0, (size_t)(((b + 7) >> 3) - (a >> 3)));
    int simd = has_avx2();
    (void)simd;
    for (int64_t lo = a, hi; lo < b; lo = hi) {
        int64_t j = lo / B;
        hi = (j + 1) * B < b ? (j + 1) * B : b;
        int64_t blk = (lo / RBLOCK + 1) * RBLOCK;
        if (blk < hi) hi = blk;
        bsum ps;
#if SDK_X86
        if (simd && (lo & 7) == 0) piece_avx2(A, lo, hi, &ps);
        else
#endif
            piece_scalar(A, lo, hi, &ps);
        if (cont && j == j0) {
            cl[A->ncont[t]++] = ps;
        } else {
            bsum *sj = &s[j - j0];
            sj->pos += ps.pos; sj->all += ps.all; sj->ab += ps.ab; sj->npos += ps.npos;
            int64_t end = (j + 1) * B < A->n ? (j + 1) * B : A->n;
            if (A->e_out && hi == end) {  /* bucket j is complete, and began in this share */
                float mp, mn;
                means_of(sj, end - j * B, &mp, &mn);
                resid_range(A->g, A->e, A->e_out, j * B, end, q_of(mp, mn), A->div, A->inv);
            }
        }
    }
}

/* Pass 1 over all threads; returns the per-bucket sums in the order defined above, or NULL when
 * out of memory. They are thread scratch: the caller ends with scratch_done(sums, *owned). */
static bsum *pass1(p1_args *A, int nt, int64_t nb, int *owned) {
    pthread_once(&rev_once, rev_init);
    /* every buffer up front: a failed allocation must stop the encoder before any residual is
     * written. Thread t's sums (zeroed: they are added to) and pieces lie in one block. */
    size_t len[SDK_MAX_THREADS], clen[SDK_MAX_THREADS], total = 0;
    for (int t = 0; t < nt; t++) {
        int64_t a, b;
        share(A->n, t, nt, RBLOCK, &a, &b);
        len[t] = clen[t] = 0;
        if (a >= b) continue;
        int64_t j0 = a / A->bucket, j1 = (b - 1) / A->bucket;
        len[t] = (size_t)(j1 - j0 + 1);
        if (j0 * A->bucket < a) clen[t] = (size_t)((b - a) / RBLOCK + 2);
        total += len[t] + clen[t];
    }
    int sums_owned, tot_owned;
    bsum *block = (bsum *)scratch(SCRATCH_SUMS, total * sizeof(bsum), &sums_owned);
    bsum *tot = block ? (bsum *)scratch(SCRATCH_TOTALS, (size_t)(nb > 0 ? nb : 1) * sizeof(bsum), &tot_owned) : NULL;
    if (!tot) {
        if (block) scratch_done(block, sums_owned);
        return NULL;
    }
    memset(tot, 0, (size_t)(nb > 0 ? nb : 1) * sizeof(bsum));
    bsum *at = block;
    for (int t = 0; t < nt; t++) {
        A->part[t] = len[t] ? at : NULL;
        if (len[t]) memset(at, 0, len[t] * sizeof(bsum));
        at += len[t];
        A->cont[t] = clen[t] ? at : NULL;
        at += clen[t];
    }
    parallel(nt, p1_task, A);
    for (int t = 0; t < nt; t++) {
        if (!A->part[t]) continue;
        int64_t a, b;
        share(A->n, t, nt, RBLOCK, &a, &b);
        int64_t j0 = a / A->bucket, j1 = (b - 1) / A->bucket;
        for (int64_t k = 0; k < A->ncont[t]; k++) {  /* bucket j0's pieces, in order */
            bsum *c = &A->cont[t][k];
            tot[j0].pos += c->pos; tot[j0].all += c->all; tot[j0].ab += c->ab; tot[j0].npos += c->npos;
        }
        for (int64_t j = A->cont[t] ? j0 + 1 : j0; j <= j1; j++) {
            bsum *c = &A->part[t][j - j0];
            tot[j].pos += c->pos; tot[j].all += c->all; tot[j].ab += c->ab; tot[j].npos += c->npos;
        }
    }
    scratch_done(block, sums_owned);
    *owned = tot_owned;
    return tot;
}

/* ---- 1-bit: pass 2 (residual) and decode ------------------------------------------------------ */

typedef struct {
    const float *g, *e_in;
    float *e_out;
    const uint8_t *bits;
    float *out;
    int64_t n, bucket;
    const qpair *q;  /* per bucket */
    int accumulate;
    float div, inv;  /* as p1_args' */
} p2_args;

static void resid_task(void *arg, int t, int nt) {
    p2_args *A = (p2_args *)arg;
    int64_t a, b;
    share(A->n, t, nt, 8, &a, &b);
    for (int64_t j = a / A->bucket; a < b; j++) {
        int64_t hi = (j + 1) * A->bucket < b ? (j + 1) * A->bucket : b;
        resid_range(A->g, A->e_in, A->e_out, a, hi, A->q[j], A->div, A->inv);
        a = hi;
    }
}

static void dec_scalar(const uint8_t *bits, float *out, int64_t a, int64_t b, float qp, float qn, int acc) {
    if (acc)
        for (int64_t i = a; i < b; i++) out[i] += (bits[i >> 3] >> (7 - (i & 7))) & 1 ? qp : qn;
    else
        for (int64_t i = a; i < b; i++) out[i] = (bits[i >> 3] >> (7 - (i & 7))) & 1 ? qp : qn;
}

#if SDK_X86
/* Whole bytes: each byte broadcast to 8 lanes, lane j tests bit 7 - j, and selects qp or qn. */
AVX2 static void dec_avx2(const uint8_t *bits, float *out, int64_t a, int64_t b, float qp, float qn, int acc) {
    const __m256i lanebit = _mm256_setr_epi32(128, 64, 32, 16, 8, 4, 2, 1);
    const __m256 vp = _mm256_set1_ps(qp), vn = _mm256_set1_ps(qn);
    for (int64_t i = a; i < b; i += 8) {
        __m256i m = _mm256_and_si256(_mm256_set1_epi32(bits[i >> 3]), lanebit);
        __m256 q = _mm256_blendv_ps(vn, vp, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, lanebit)));
        if (acc) q = _mm256_add_ps(_mm256_loadu_ps(out + i), q);
        _mm256_storeu_ps(out + i, q);
    }
}
#endif

static void decode_task(void *arg, int t, int nt) {
    p2_args *A = (p2_args *)arg;
    int64_t a, b;
    share(A->n, t, nt, 8, &a, &b);
    int simd = has_avx2();
    (void)simd;
    for (int64_t j = a / A->bucket; a < b; j++) {
        int64_t hi = (j + 1) * A->bucket < b ? (j + 1) * A->bucket : b;
        float qp = A->q[j].qp, qn = A->q[j].qn;
#if SDK_X86
        int64_t m0 = (a + 7) & ~(int64_t)7, m1 = hi & ~(int64_t)7;
        if (simd && m0 < m1) {
            dec_scalar(A->bits, A->out, a, m0, qp, qn, A->accumulate);
            dec_avx2(A->bits, A->out, m0, m1, qp, qn, A->accumulate);
            dec_scalar(A->bits, A->out, m1, hi, qp, qn, A->accumulate);
            a = hi;
            continue;
        }
#endif
        dec_scalar(A->bits, A->out, a, hi, qp, qn, A->accumulate);
        a = hi;
    }
}

int sdk_onebit_encode(const float *g, const float *e_in, const float *pending, float *e_out, int defer, int64_t n,
                      int64_t bucket, float *means, uint8_t *bits, float div) {
    if (n <= 0) return 0;
    if (bucket < 1 || bucket > n) bucket = n;
    if (pending && e_in && !(defer && e_out)) return -2;  /* the residual passes read e_in as it is */
    int64_t nb = (n + bucket - 1) / bucket;
    int nt = threads_for(n);
    p1_args A;
    memset(&A, 0, sizeof A);
    A.g = g; A.e = e_in; A.n = n; A.bucket = bucket; A.bits = bits; A.div = div; A.inv = exact_inverse(div);
    A.pend = e_in ? (const qpair *)pending : NULL;
    if (defer) A.p_out = e_out;
    int fused = e_out && !defer && bucket <= RBLOCK;  /* a bucket then spans at most two shares */
    A.e_out = fused ? e_out : NULL;
    /* every allocation before the first write: out of memory leaves bits, means and e as they were */
    int two_pass = e_out && !defer && !fused, q_owned = 0, s_owned;
    qpair *q = two_pass ? (qpair *)scratch(SCRATCH_PAIRS, (size_t)nb * sizeof(qpair), &q_owned) : NULL;
    if (two_pass && !q) return -1;
    bsum *s = pass1(&A, nt, nb, &s_owned);
    if (!s) { scratch_done(q, q_owned); return -1; }
    for (int64_t j = 0; j < nb; j++) {
        int64_t len = (j + 1) * bucket < n ? bucket : n - j * bucket;
        means_of(&s[j], len, &means[2 * j], &means[2 * j + 1]);
        if (q) q[j] = q_of(means[2 * j], means[2 * j + 1]);
    }
    scratch_done(s, s_owned);
    if (fused) {
        /* the buckets cut by a share boundary, whose sums came together only now */
        for (int t = 1; t < nt; t++) {
            int64_t a, b;
            share(n, t, nt, RBLOCK, &a, &b);
            if (a >= b || a % bucket == 0) continue;
            int64_t j = a / bucket, end = (j + 1) * bucket < n ? (j + 1) * bucket : n;
            resid_range(g, e_in, e_out, j * bucket, end, q_of(means[2 * j], means[2 * j + 1]), div, A.inv);
        }
    } else if (q) {
        p2_args P = {g, e_in, e_out, bits, NULL, n, bucket, q, 0, div, A.inv};
        parallel(nt, resid_task, &P);
    }
    scratch_done(q, q_owned);
    return 0;
}

int sdk_onebit_decode(const float *means, const uint8_t *bits, int64_t n, int64_t bucket, float *out,
                      int accumulate) {
    if (n <= 0) return 0;
    if (bucket < 1 || bucket > n) bucket = n;
    int64_t nb = (n + bucket - 1) / bucket;
    int owned;
    qpair *q = (qpair *)scratch(SCRATCH_PAIRS, (size_t)nb * sizeof(qpair), &owned);
    if (!q) return -1;
    for (int64_t j = 0; j < nb; j++) q[j] = q_of(means[2 * j], means[2 * j + 1]);
    p2_args P = {NULL, NULL, NULL, bits, out, n, bucket, q, accumulate, 1.0f, 1.0f};
    parallel(threads_for(n), decode_task, &P);
    scratch_done(q, owned);
    return 0;
}

int sdk_scaled_sign_encode(const float *g, const float *e_in, const float *pending, float *p_out, int64_t n,
                           int64_t bucket, uint8_t *bits, float *scales, float div) {
    if (n <= 0) { scales[0] = 0.0f; return 0; }
    if (bucket < 1 || bucket > n) bucket = n;
    int64_t nb = (n + bucket - 1) / bucket;
    p1_args A;
    memset(&A, 0, sizeof A);
    A.g = g; A.e = e_in; A.n = n; A.bucket = bucket; A.bits = bits; A.scaled = 1; A.div = div; A.inv = exact_inverse(div);
    A.pend = e_in ? (const qpair *)pending : NULL;
    A.p_out = p_out;
    /* pass1 allocates everything before its first write: out of memory leaves e_in as it was */
    int owned;
    bsum *s = pass1(&A, threads_for(n), nb, &owned);
    if (!s) return -1;
    for (int64_t j = 0; j < nb; j++) {
        int64_t len = (j + 1) * bucket < n ? bucket : n - j * bucket;
        scales[j] = (float)(s[j].ab / (double)len);
    }
    scratch_done(s, owned);
    return 0;
}

int sdk_scaled_sign_decode(const float *scales, const uint8_t *bits, int64_t n, int64_t bucket, float *out,
                           int accumulate) {
    if (n <= 0) return 0;
    if (bucket < 1 || bucket > n) bucket = n;
    int64_t nb = (n + bucket - 1) / bucket;
    int owned = 0;
    qpair one, *q = nb == 1 ? &one : (qpair *)scratch(SCRATCH_PAIRS, (size_t)nb * sizeof(qpair), &owned);
    if (!q) return -1;
    for (int64_t j = 0; j < nb; j++) q[j] = (qpair){scales[j], -scales[j]};
    p2_args P = {NULL, NULL, NULL, bits, out, n, bucket, q, accumulate, 1.0f, 1.0f};
    parallel(threads_for(n), decode_task, &P);
    if (q != &one) scratch_done(q, owned);
    return 0;
}

/* ---- float16 / bfloat16 ---------------------------------------------------------------------- */

/* Round to nearest even, subnormals and overflow to inf included (what F16C does). */
static uint16_t f2h(float f) {
    uint32_t x = f2u(f), sign = (x >> 16) & 0x8000;
    x &= 0x7fffffff;
    if (x > 0x7f800000) return (uint16_t)(sign | 0x7e00 | ((x >> 13) & 0x3ff));
    if (x >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  /* >= 65520 rounds to inf */
    if (x < 0x38800000) {  /* below 2^-14: a half subnormal; adding 0.5 rounds at 2^-24 */
        float a = u2f(x) + 0.5f;
        return (uint16_t)(sign | (f2u(a) - 0x3f000000));
    }
    x += 0xc8000fffu + ((x >> 13) & 1);  /* rebias exponent by -112, round half to even */
    return (uint16_t)(sign | (x >> 13));
}

static float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) return u2f(sign | f2u((float)m * 5.9604644775390625e-8f));
    if (e == 31) return u2f(sign | 0x7f800000 | (m << 13));
    return u2f(sign | ((e + 112) << 23) | (m << 13));
}

/* torch's c10::BFloat16 rounding: NaN -> quiet NaN, else round half to even on the top 16 bits. */
static uint16_t f2bf(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16 & 0x8000) | 0x7fc0);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

typedef struct { const void *src; void *dst; int64_t n; float scale; int kind, acc; } cvt_args;

#if SDK_X86
AVX2F16C static void f2h_f16c(const float *x, uint16_t *h, int64_t a, int64_t b, float scale) {
    __m256 s = _mm256_set1_ps(scale);
    for (; a + 8 <= b; a += 8)
        _mm_storeu_si128((__m128i *)(h + a),
                         _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(x + a), s), _MM_FROUND_TO_NEAREST_INT));
    for (; a < b; a++) h[a] = f2h(x[a] * scale);
}

AVX2F16C static void h2f_f16c(const uint16_t *h, float *x, int64_t a, int64_t b, int acc) {
    if (acc) {
        for (; a + 8 <= b; a += 8)
            _mm256_storeu_ps(x + a, _mm256_add_ps(_mm256_loadu_ps(x + a),
                                                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + a)))));
        for (; a < b; a++) x[a] += h2f(h[a]);
        return;
    }
    for (; a + 8 <= b; a += 8) _mm256_storeu_ps(x + a, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + a))));
    for (; a < b; a++) x[a] = h2f(h[a]);
}

AVX2 static void f2bf_avx2(const float *x, uint16_t *h, int64_t a, int64_t b, float scale) {
    const __m256 s = _mm256_set1_ps(scale);
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i qnan = _mm256_set1_epi32(0x7fc0), signm = _mm256_set1_epi32(0x8000);
    for (; a + 16 <= b; a += 16) {
        __m256i r[2];
        for (int k = 0; k < 2; k++) {
            __m256i u = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x + a + 8 * k), s));
            __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
            __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), odd), 16);
            __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
            __m256i nanv = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), signm), qnan);
            r[k] = _mm256_blendv_epi8(rounded, nanv, isnan);
        }
        /* packus works per 128-bit lane: reorder the quadwords back into element order */
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8);
        _mm256_storeu_si256((__m256i *)(h + a), p);
    }
    for (; a < b; a++) h[a] = f2bf(x[a] * scale);
}

AVX2 static void bf2f_avx2(const uint16_t *h, float *x, int64_t a, int64_t b, int acc) {
    for (; a + 8 <= b; a += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + a)));
        __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        _mm256_storeu_ps(x + a, acc ? _mm256_add_ps(_mm256_loadu_ps(x + a), f) : f);
    }
    for (; a < b; a++) x[a] = acc ? x[a] + u2f((uint32_t)h[a] << 16) : u2f((uint32_t)h[a] << 16);
}
#endif

static void cvt_task(void *arg, int t, int nt) {
    cvt_args *A = (cvt_args *)arg;
    int64_t a, b;
    share(A->n, t, nt, 64, &a, &b);
    const float *xf = (const float *)A->src;
    const uint16_t *xh = (const uint16_t *)A->src;
    float *of = (float *)A->dst;
    uint16_t *oh = (uint16_t *)A->dst;
    switch (A->kind) {
    case 0:
#if SDK_X86
        if (has_f16c()) { f2h_f16c(xf, oh, a, b, A->scale); break; }
#endif
        for (int64_t i = a; i < b; i++) oh[i] = f2h(xf[i] * A->scale);
        break;
    case 1:
#if SDK_X86
        if (has_f16c()) { h2f_f16c(xh, of, a, b, A->acc); break; }
#endif
        if (A->acc) for (int64_t i = a; i < b; i++) of[i] += h2f(xh[i]);
        else for (int64_t i = a; i < b; i++) of[i] = h2f(xh[i]);
        break;
    case 2:
#if SDK_X86
        if (has_avx2()) { f2bf_avx2(xf, oh, a, b, A->scale); break; }
#endif
        for (int64_t i = a; i < b; i++) oh[i] = f2bf(xf[i] * A->scale);
        break;
    default:
#if SDK_X86
        if (has_avx2()) { bf2f_avx2(xh, of, a, b, A->acc); break; }
#endif
        if (A->acc) for (int64_t i = a; i < b; i++) of[i] += u2f((uint32_t)xh[i] << 16);
        else for (int64_t i = a; i < b; i++) of[i] = u2f((uint32_t)xh[i] << 16);
    }
}

static void convert(const void *src, void *dst, int64_t n, float scale, int kind, int acc) {
    if (n <= 0) return;
    cvt_args A = {src, dst, n, scale, kind, acc};
    parallel(threads_for(n), cvt_task, &A);
}

void sdk_f32_to_f16(const float *x, uint16_t *h, int64_t n, float scale) { convert(x, h, n, scale, 0, 0); }
void sdk_f16_to_f32(const uint16_t *h, float *x, int64_t n, int accumulate) { convert(h, x, n, 1.0f, 1, accumulate); }
void sdk_f32_to_bf16(const float *x, uint16_t *h, int64_t n, float scale) { convert(x, h, n, scale, 2, 0); }
void sdk_bf16_to_f32(const uint16_t *h, float *x, int64_t n, int accumulate) { convert(h, x, n, 1.0f, 3, accumulate); }

/* ---- QSGD ------------------------------------------------------------------------------------ */

#define QCHUNK 65536  /* threads cut their shares here */
#define QFUSE_ELEMS 16384  /* buckets up to this size: norm and codes in one pass over memory */

/* The rounding noise is counter-based: element i's uniform is a hash of (i, seed), so it does
 * not depend on threads or SIMD, and the torch path (spark_dl/compression/rng.py,
 * counter_uniform) computes the same floats. x = i_lo * 0x9E3779B1 + k0 + i_hi * 0x85EBCA77
 * (mod 2^32), h = fmix32(x) ^ k1 (MurmurHash3's finalizer), u = (h >> 8) * 2^-24. */
static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
    return h;
}

static inline float qrand(uint64_t i, uint64_t seed) {
    uint32_t x = (uint32_t)i * 0x9E3779B1u + (uint32_t)seed + (uint32_t)(i >> 32) * 0x85EBCA77u;
    return (float)((fmix32(x) ^ (uint32_t)(seed >> 32)) >> 8) * 5.9604644775390625e-8f;
}

/* Codes of 8 elements sharing the factor f: floor(|v| f + u) by truncation (the sum is >= 0),
 * clamped to s; NaN quantizes to zero. */
#define QCODES8(x, f, u, L, c)                                                               \
    for (int l = 0; l < 8; l++) {                                                            \
        float tv = fabsf(x[l]) * f + u[l];                                                   \
        int lvl = tv < (float)L ? (int)tv : L;                                               \
        lvl = tv == tv ? lvl : 0;                                                            \
        c[l] = (uint8_t)(signbit(x[l]) ? L - lvl : L + lvl);                                 \
    }

static void qgroup_scalar(uint64_t i, uint64_t seed, const float *x, float f, int L, uint8_t *c) {
    float u[8];
    for (int l = 0; l < 8; l++) u[l] = qrand(i + (uint64_t)l, seed);
    QCODES8(x, f, u, L, c)
}

typedef struct {
    const float *x;
    int64_t n, bucket, nb;
    int levels, bits;
    uint64_t seed;
    int max_norm;  /* scale by max |v| instead of ||v||_2 */
    float *norms, *factor;
    uint8_t *packed;
    const float *scales;  /* decode: the norms; each bucket's scale is norm / s, as torch divides */
    float *out;
    int accumulate;
} q_args;

/* Sum of squares of one piece [lo, hi) in 8 double lanes (see "deterministic sums"). */
/* Squares of [i, hi) of the piece that starts at lo, into its lanes; then the lanes' sum. */
static double sumsq_lanes(const float *x, int64_t lo, int64_t i, int64_t hi, double *a) {
    for (; i < hi; i++) {
        double v = (double)x[i];
        a[(i - lo) & 7] += v * v;
    }
    return lanes8(a);
}

static double sumsq_scalar(const float *x, int64_t lo, int64_t hi) {
    double a[8] = {0};
    return sumsq_lanes(x, lo, lo, hi, a);
}

#if SDK_X86
AVX2 static double sumsq_avx2(const float *x, int64_t lo, int64_t hi) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256d v0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), v1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        a0 = _mm256_add_pd(a0, _mm256_mul_pd(v0, v0));
        a1 = _mm256_add_pd(a1, _mm256_mul_pd(v1, v1));
    }
    double a[8];
    _mm256_storeu_pd(a, a0);
    _mm256_storeu_pd(a + 4, a1);
    return sumsq_lanes(x, lo, i, hi, a);  /* the tail continues the lanes */
}
#endif

/* ||x[lo, hi)||: pieces cut at multiples of RBLOCK, added in order; sqrt in double. */
static float qnorm(const float *x, int64_t lo, int64_t hi) {
    double ss = 0.0;
    int simd = has_avx2();
    (void)simd;
    for (int64_t p = lo, e; p < hi; p = e) {
        e = (p / RBLOCK + 1) * RBLOCK;
        if (e > hi) e = hi;
#if SDK_X86
        if (simd) { ss += sumsq_avx2(x, p, e); continue; }
#endif
        ss += sumsq_scalar(x, p, e);
    }
    return (float)sqrt(ss);
}

static float qmax_scalar(const float *x, int64_t lo, int64_t hi, float m) {
    for (int64_t i = lo; i < hi; i++) {
        float a = fabsf(x[i]);
        m = a > m || a != a ? a : m;  /* once NaN, no compare is true: NaN stays */
    }
    return m;
}

#if SDK_X86
/* The same maximum, 32 elements an iteration in four independent chains: the scalar loop makes
 * one dependent compare-and-select per element, slower than the rest of the encoder. A maximum of
 * non-negative numbers is exact in any order; a bucket holding a NaN is measured again by the
 * scalar loop, so which NaN it returns stays the scalar loop's. */
AVX2 static float qmax_avx2(const float *x, int64_t lo, int64_t hi) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m0 = _mm256_setzero_ps(), m1 = m0, m2 = m0, m3 = m0, bad = m0;
    int64_t i = lo;
    for (; i + 32 <= hi; i += 32) {
        __m256 a0 = _mm256_and_ps(_mm256_loadu_ps(x + i), absmask);
        __m256 a1 = _mm256_and_ps(_mm256_loadu_ps(x + i + 8), absmask);
        __m256 a2 = _mm256_and_ps(_mm256_loadu_ps(x + i + 16), absmask);
        __m256 a3 = _mm256_and_ps(_mm256_loadu_ps(x + i + 24), absmask);
        bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(a0, a1, _CMP_UNORD_Q), _mm256_cmp_ps(a2, a3, _CMP_UNORD_Q)));
        m0 = _mm256_max_ps(m0, a0);
        m1 = _mm256_max_ps(m1, a1);
        m2 = _mm256_max_ps(m2, a2);
        m3 = _mm256_max_ps(m3, a3);
    }
    if (_mm256_movemask_ps(bad)) return qmax_scalar(x, lo, hi, 0.0f);
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    float m = 0.0f;
    for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
    return qmax_scalar(x, i, hi, m);  /* the tail, NaN included */
}
#endif

/* max |x[lo, hi)|, NaN when any element is NaN (as torch's amax) */
static float qmax(const float *x, int64_t lo, int64_t hi) {
#if SDK_X86
    if (has_avx2()) return qmax_avx2(x, lo, hi);
#endif
    return qmax_scalar(x, lo, hi, 0.0f);
}

static float qscale(const q_args *A, int64_t lo, int64_t hi) {
    return A->max_norm ? qmax(A->x, lo, hi) : qnorm(A->x, lo, hi);
}

/* as QSGD.compress: s / max(norm, tiny); an all-zero bucket quantizes to zero */
static float qfactor(int levels, float norm) {
    /* clamp_min keeps NaN (a bucket holding NaN): its codes are then all zero, as in torch */
    return (float)levels / (norm > 1.17549435e-38f || norm != norm ? norm : 1.17549435e-38f);
}

static void qnorm_task(void *arg, int t, int nt) {
    q_args *A = (q_args *)arg;
    int64_t j0, j1;
    share(A->nb, t, nt, 1, &j0, &j1);
    for (int64_t j = j0; j < j1; j++) {
        int64_t lo = j * A->bucket, hi = lo + A->bucket < A->n ? lo + A->bucket : A->n;
        A->norms[j] = qscale(A, lo, hi);
        A->factor[j] = qfactor(A->levels, A->norms[j]);
    }
}

/* Codes of 8 consecutive elements (or fewer at the end) into packed, layout of bits.pack. */
static inline void put8(uint8_t *packed, int64_t n, int bits, int64_t i, const uint8_t *c, int cnt) {
    if (bits == 4 && cnt == 8) {
        for (int k = 0; k < 4; k++) packed[(i >> 1) + k] = (uint8_t)(c[2 * k] << 4 | c[2 * k + 1]);
    } else if (8 % bits == 0) {
        int per = 8 / bits;
        for (int k = 0; k < cnt; k += per) {
            uint8_t v = 0;
            for (int m = 0; m < per; m++) v = (uint8_t)((v << bits) | (k + m < cnt ? c[k + m] : 0));
            packed[(i + k) / per] = v;
        }
    } else {
        int64_t plane = (n + 7) / 8;
        for (int b = 0; b < bits; b++) {
            uint8_t v = 0;
            for (int m = 0; m < 8; m++) v = (uint8_t)((v << 1) | (m < cnt ? (c[m] >> b) & 1 : 0));
            packed[b * plane + (i >> 3)] = v;
        }
    }
}

static inline void get8(const uint8_t *packed, int64_t n, int bits, int64_t i, uint8_t *c, int cnt) {
    if (bits == 4 && cnt == 8) {
        for (int k = 0; k < 4; k++) { c[2 * k] = packed[(i >> 1) + k] >> 4; c[2 * k + 1] = packed[(i >> 1) + k] & 15; }
    } else if (8 % bits == 0) {
        int per = 8 / bits, mask = (1 << bits) - 1;
        for (int k = 0; k < cnt; k++) {  /* not past cnt: the last byte may hold fewer codes */
            int64_t e = i + k;
            c[k] = (uint8_t)((packed[e / per] >> ((per - 1 - (int)(e % per)) * bits)) & mask);
        }
    } else {
        int64_t plane = (n + 7) / 8;
        for (int k = 0; k < 8; k++) c[k] = 0;
        for (int b = 0; b < bits; b++) {
            uint8_t v = packed[b * plane + (i >> 3)];
            for (int k = 0; k < 8; k++) c[k] |= (uint8_t)(((v >> (7 - k)) & 1) << b);
        }
    }
}

#if SDK_X86
/* 4-bit codes, AVX2 throughout: the hash noise 8 lanes at a time; lane arithmetic is the
 * scalar path's (fl(fl(|x| f) + u), truncation, clamp, NaN -> 0), so the codes are bit-for-bit
 * those of qenc_range. Returns where it stopped: the end, or a group that crosses a bucket edge
 * or the end (left to the scalar code). Groups start at multiples of 8, so i_hi is one per group. */
AVX2 static inline __m256i fmix32x8(__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x85EBCA6Bu));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0xC2B2AE35u));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

/* 8 lanes' 4-bit codes (as int32 in [0, 2s]) for elements base.. of one bucket with factor f.
 * finite: the bucket's factor is finite and > 0, so its norm is finite and no element is NaN or
 * infinite; then |x| f <= s up to rounding and tv < s + 2, so min() clamps exactly as the general
 * lanes' compare-and-blend, and no NaN needs masking: the same codes in fewer operations. */
AVX2 static inline __m256i qcodes8_avx2(const float *x, uint32_t base, __m256 f, __m256i lane, __m256i k1,
                                        __m256 Lf, __m256i Li, int finite) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 unit = _mm256_set1_ps(5.9604644775390625e-8f);
    __m256i h = _mm256_xor_si256(fmix32x8(_mm256_add_epi32(_mm256_set1_epi32((int)base), lane)), k1);
    __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), unit);
    __m256 v = _mm256_loadu_ps(x);
    __m256 tv = _mm256_add_ps(_mm256_mul_ps(_mm256_and_ps(v, absmask), f), u);
    if (finite) {
        /* sign_epi32 negates where x's bits are negative; x = +0.0 (bits 0) has level 0 anyway */
        __m256i lvl = _mm256_min_epi32(_mm256_cvttps_epi32(tv), Li);
        return _mm256_add_epi32(Li, _mm256_sign_epi32(lvl, _mm256_castps_si256(v)));
    }
    __m256i lvl = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(Li),
        _mm256_castsi256_ps(_mm256_cvttps_epi32(tv)), _mm256_cmp_ps(tv, Lf, _CMP_LT_OQ)));
    lvl = _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(tv, tv, _CMP_UNORD_Q)), lvl);
    __m256i sg = _mm256_srai_epi32(_mm256_castps_si256(v), 31);  /* -1 where the sign bit is set */
    return _mm256_add_epi32(Li, _mm256_sub_epi32(_mm256_xor_si256(lvl, sg), sg));
}

static inline uint32_t qbase(int64_t i, uint64_t seed) {
    return (uint32_t)i * 0x9E3779B1u + (uint32_t)seed + (uint32_t)((uint64_t)i >> 32) * 0x85EBCA77u;
}

AVX2 static int64_t qenc4_avx2(q_args *A, int64_t i, int64_t hi, const float *factor, int64_t fj) {
    const int64_t B = A->bucket;
    const float *x = A->x;  /* locals: the byte stores below could alias *A, which forces reloads */
    uint8_t *packed = A->packed;
    const uint64_t seed = A->seed;
    const __m256 Lf = _mm256_set1_ps((float)A->levels);
    const __m256i Li = _mm256_set1_epi32(A->levels);
    const __m256i pick = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i nibbles = _mm_set1_epi16(0x0110);  /* (byte 2k) * 16 + (byte 2k+1) * 1 */
    const __m256i golden = _mm256_set1_epi32((int)0x9E3779B1u);
    const __m256i lane = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), golden);
    const __m256i k1 = _mm256_set1_epi32((int)(uint32_t)(seed >> 32));
    int64_t j = i / B, edge = (j + 1) * B;  /* no division per group: it cost more than the rest */
    __m256 f = _mm256_set1_ps(factor[j - fj]);
    int finite = factor[j - fj] > 0.0f && factor[j - fj] < INFINITY;  /* false for NaN too */
    for (; i + 8 <= hi; ) {
        if (i >= edge) {
            j = i / B;
            edge = (j + 1) * B;
            f = _mm256_set1_ps(factor[j - fj]);
            finite = factor[j - fj] > 0.0f && factor[j - fj] < INFINITY;
        }
        if (i + 16 <= edge && i + 16 <= hi) {
            /* The next block's line, one per 16 elements (64 bytes): its norms then read it from
             * cache while this compute-bound loop hides the memory latency (a prefetch past the
             * end of the array is a hint, never a fault). */
            _mm_prefetch((const char *)(x + i + QFUSE_ELEMS), _MM_HINT_T0);
            /* 16 codes: two independent chains, packed to 8 bytes with one store */
            __m256i c0, c1;
            if (finite) {
                c0 = qcodes8_avx2(x + i, qbase(i, seed), f, lane, k1, Lf, Li, 1);
                c1 = qcodes8_avx2(x + i + 8, qbase(i + 8, seed), f, lane, k1, Lf, Li, 1);
            } else {
                c0 = qcodes8_avx2(x + i, qbase(i, seed), f, lane, k1, Lf, Li, 0);
                c1 = qcodes8_avx2(x + i + 8, qbase(i + 8, seed), f, lane, k1, Lf, Li, 0);
            }
            __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(c0, c1), 0xD8);  /* 16 x u16, in order */
            __m128i b = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            __m128i pairs = _mm_maddubs_epi16(b, nibbles);
            _mm_storel_epi64((__m128i *)(packed + (i >> 1)), _mm_packus_epi16(pairs, pairs));
            i += 16;
            continue;
        }
        if (i + 8 > edge) break;
        __m256i c = qcodes8_avx2(x + i, qbase(i, seed), f, lane, k1, Lf, Li, 0);
        /* lanes (2k, 2k+1) -> one byte c[2k] << 4 | c[2k+1] at the bottom of each 64-bit lane */
        __m256i pr = _mm256_or_si256(_mm256_slli_epi64(c, 4), _mm256_srli_epi64(c, 32));
        pr = _mm256_shuffle_epi8(pr, pick);
        uint32_t w = (uint32_t)(uint16_t)_mm256_extract_epi16(pr, 0) | (uint32_t)(uint16_t)_mm256_extract_epi16(pr, 8) << 16;
        memcpy(packed + (i >> 1), &w, 4);
        i += 8;
    }
    return i;
}
#endif

/* Encodes [lo, hi) of the thread's share; factor[j - fj] is bucket j's factor. */
static void qenc_range(q_args *A, int64_t lo, int64_t hi, const float *factor, int64_t fj) {
    const int L = A->levels;
    const int64_t B = A->bucket;
    int simd = has_avx2();
    (void)simd;
    uint8_t c[8];
    float x[8], f[8];
    for (int64_t i = lo; i < hi; i += 8) {
#if SDK_X86
        if (simd && A->bits == 4 && A->levels <= 7) {
            i = qenc4_avx2(A, i, hi, factor, fj);
            if (i >= hi) break;
        }
#endif
        int cnt = hi - i < 8 ? (int)(hi - i) : 8;
        int64_t j = i / B;
        if (cnt == 8 && (i + 7) / B == j) {  /* the common case: 8 elements of one bucket */
            qgroup_scalar((uint64_t)i, A->seed, A->x + i, factor[j - fj], L, c);
        } else {  /* a bucket edge or the end: per-element factors, zero padding */
            float u[8];
            for (int k = 0; k < 8; k++) {
                u[k] = qrand((uint64_t)(i + k), A->seed);
                x[k] = k < cnt ? A->x[i + k] : 0.0f;
                f[k] = k < cnt ? factor[(i + k) / B - fj] : 0.0f;
            }
            for (int k = 0; k < 8; k++) {
                float tv = fabsf(x[k]) * f[k] + u[k];
                int lvl = tv < (float)L ? (int)tv : L;
                lvl = tv == tv ? lvl : 0;
                c[k] = (uint8_t)(signbit(x[k]) ? L - lvl : L + lvl);
            }
        }
        put8(A->packed, A->n, A->bits, i, c, cnt);
    }
}


static void qenc_task(void *arg, int t, int nt) {
    q_args *A = (q_args *)arg;
    int64_t a, b;
    share(A->n, t, nt, QCHUNK, &a, &b);
    if (a >= b) return;
    const int64_t B = A->bucket;
    if (A->factor) {  /* norms already computed by qnorm_task */
        qenc_range(A, a, b, A->factor, 0);
        return;
    }
    /* Blocks of about QFUSE_ELEMS elements (whole buckets when the bucket divides it), cut at
     * multiples of 8 so groups fall as in one sweep: the block's norms are
     * computed first, reading it from memory once, then its codes from cache. A bucket cut by
     * a block or thread boundary is normed by both sides alike; norms[j] is written by the
     * block that holds its start. */
    int64_t target = (QFUSE_ELEMS / B) * B;
    target = (target + 7) & ~(int64_t)7;
    float local[QFUSE_ELEMS + 2];
    for (int64_t lo = a, hi; lo < b; lo = hi) {
        hi = lo + target < b ? lo + target : b;
        int64_t jb = lo / B, jl = (hi - 1) / B;
        for (int64_t j = jb; j <= jl; j++) {
            int64_t blo = j * B, bhi = blo + B < A->n ? blo + B : A->n;
            float norm = qscale(A, blo, bhi);
            if (blo >= lo) A->norms[j] = norm;
            local[j - jb] = qfactor(A->levels, norm);
        }
        qenc_range(A, lo, hi, local, jb);
    }
}

#if SDK_X86
/* 4-bit codes -> (code - s) * scale, 8 at a time while a group stays in one bucket; the scalar
 * path's float operations, so bit-for-bit the same. Returns where it stopped. */
AVX2 static int64_t qdec4_avx2(const q_args *A, int64_t i, int64_t b, int64_t *jp, int64_t *endp) {
    const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i shift = _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0), nib = _mm256_set1_epi32(15);
    const __m256i L = _mm256_set1_epi32(A->levels);
    int64_t j = *jp, end = *endp;
    __m256 sc = _mm256_set1_ps(A->scales[j] / (float)A->levels);
    for (; i + 8 <= b; i += 8) {
        if (i >= end) {
            j = i / A->bucket;
            end = (j + 1) * A->bucket;
            sc = _mm256_set1_ps(A->scales[j] / (float)A->levels);
        }
        if (i + 8 > end) break;
        uint32_t w;
        memcpy(&w, A->packed + (i >> 1), 4);
        __m256i c = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)w), dup));
        c = _mm256_and_si256(_mm256_srlv_epi32(c, shift), nib);
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(c, L)), sc);
        if (A->accumulate) v = _mm256_add_ps(_mm256_loadu_ps(A->out + i), v);
        _mm256_storeu_ps(A->out + i, v);
    }
    *jp = j;
    *endp = end;
    return i;
}
#endif

static void qdec_task(void *arg, int t, int nt) {
    q_args *A = (q_args *)arg;
    int64_t a, b;
    share(A->n, t, nt, 8, &a, &b);
    uint8_t c[8];
    int64_t j = a / A->bucket, end = (j + 1) * A->bucket;
    float sc = A->scales[j] / (float)A->levels;
    int simd = has_avx2() && A->bits == 4;
    (void)simd;
    for (int64_t i = a; i < b; i += 8) {
#if SDK_X86
        if (simd) {
            i = qdec4_avx2(A, i, b, &j, &end);
            if (i >= b) break;
            sc = A->scales[j] / (float)A->levels;
            if (i >= end) {  /* the next group starts a new bucket but runs past b */
                j = i / A->bucket;
                end = (j + 1) * A->bucket;
                sc = A->scales[j] / (float)A->levels;
            }
        }
#endif
        int cnt = b - i < 8 ? (int)(b - i) : 8;
        get8(A->packed, A->n, A->bits, i, c, cnt);
        if (cnt == 8 && i + 8 <= end) {
            float v[8];
            for (int k = 0; k < 8; k++) v[k] = (float)((int)c[k] - A->levels) * sc;
            if (A->accumulate) for (int k = 0; k < 8; k++) A->out[i + k] += v[k];
            else for (int k = 0; k < 8; k++) A->out[i + k] = v[k];
            continue;
        }
        for (int k = 0; k < cnt; k++) {
            if (i + k == end) { sc = A->scales[++j] / (float)A->levels; end += A->bucket; }
            float v = (float)((int)c[k] - A->levels) * sc;
            if (A->accumulate) A->out[i + k] += v;
            else A->out[i + k] = v;
        }
    }
}

int sdk_qsgd_encode(const float *x, int64_t n, int64_t bucket, int levels, int code_bits, uint64_t seed,
                    int max_norm, float *norms, uint8_t *packed) {
    if (n <= 0) return 0;
    if (bucket < 1 || bucket > n) bucket = n;
    int64_t nb = (n + bucket - 1) / bucket;
    q_args A = {x, n, bucket, nb, levels, code_bits, seed, max_norm != 0, norms, NULL, packed, NULL, NULL, 0};
    int nt = threads_for(n);
    if (bucket > QFUSE_ELEMS) {  /* big buckets: a norm pass, then a code pass */
        A.factor = (float *)k_malloc((size_t)nb * sizeof(float));
        if (!A.factor) return -1;
        parallel(nb >= nt ? nt : 1, qnorm_task, &A);
    }
    parallel(nt, qenc_task, &A);
    free(A.factor);
    return 0;
}

void sdk_qsgd_decode(const float *norms, const uint8_t *packed, int64_t n, int64_t bucket, int levels,
                     int code_bits, float *out, int accumulate) {
    if (n <= 0) return;
    if (bucket < 1 || bucket > n) bucket = n;
    q_args A = {NULL, n, bucket, (n + bucket - 1) / bucket, levels, code_bits, 0, 0, NULL, NULL,
                (uint8_t *)packed, norms, out, accumulate};
    parallel(threads_for(n), qdec_task, &A);
}

/* ---- top-k by |x| ---------------------------------------------------------------------------- */

/* |x|'s bits order like |x| itself (NaN above inf): select on integer keys, in two radix
 * levels of 16 bits. Level 1 is a histogram over the whole vector; only the elements in the
 * boundary bin are kept as candidates for level 2. */
#define HBINS 32768

/* Level 1's cut from per-thread histograms (hist[t][j] counts bin lo + j, bins lo..HBINS-1): the
 * bin holding the k-th largest key (never below lo), how many keys lie above it, and each
 * thread's offsets, in thread order (index order), into the output for its keys above that bin
 * (out_at) and into the boundary bin's list (edge_at); *nedge: that list's length. */
static int64_t tk_cut(int64_t *const *hist, int nt, int64_t lo, int64_t k, int64_t *above,
                      int64_t *out_at, int64_t *edge_at, int64_t *nedge) {
    int64_t a = 0, bin = HBINS - 1;
    for (; bin > lo; bin--) {
        int64_t c = 0;
        for (int t = 0; t < nt; t++) c += hist[t][bin - lo];
        if (a + c >= k) break;
        a += c;
    }
    int64_t o = 0, e = 0;
    for (int t = 0; t < nt; t++) {
        out_at[t] = o;
        edge_at[t] = e;
        for (int64_t j = bin + 1; j < HBINS; j++) o += hist[t][j - lo];
        e += hist[t][bin - lo];
    }
    *above = a;
    *nedge = e;
    return bin;
}

/* Level 2's cut over the boundary bin's low 16 bits (h2): the lowest low-bits value taken, and
 * in *ties how many keys equal to it are taken (the first ones by index) to make up need. */
static int64_t tk_cut2(const int64_t *h2, int64_t need, int64_t *ties) {
    int64_t above2 = 0, low = 65535;
    for (; low > 0; low--) {
        if (above2 + h2[low] >= need) break;
        above2 += h2[low];
    }
    *ties = need - above2;
    return low;
}

typedef struct {
    const float *x;
    int64_t n, k, bin;
    int64_t *hist[SDK_MAX_THREADS];
    int64_t out_at[SDK_MAX_THREADS], cand_at[SDK_MAX_THREADS];
    int64_t *idx, *cand;
    float *val;
} tk_args;

static inline uint32_t key_of(float f) { return f2u(f) & 0x7fffffff; }

static void tk_hist_task(void *arg, int t, int nt) {
    tk_args *A = (tk_args *)arg;
    int64_t a, b;
    share(A->n, t, nt, 64, &a, &b);
    int64_t *h = A->hist[t];
    /* Gradients crowd a few hundred bins: four 32-bit sub-histograms break the chains of
     * increments to one bin (store-to-load stalls); flushed before they could overflow. */
    uint32_t *sub = (uint32_t *)k_calloc(4 * HBINS, sizeof(uint32_t));
    if (!sub) {
        for (int64_t i = a; i < b; i++) h[key_of(A->x[i]) >> 16]++;
        return;
    }
    for (int64_t i = a; i < b;) {
        int64_t stop = b - i > ((int64_t)1 << 30) ? i + ((int64_t)1 << 30) : b;
        for (; i + 4 <= stop; i += 4) {
            sub[key_of(A->x[i]) >> 16]++;
            sub[HBINS + (key_of(A->x[i + 1]) >> 16)]++;
            sub[2 * HBINS + (key_of(A->x[i + 2]) >> 16)]++;
            sub[3 * HBINS + (key_of(A->x[i + 3]) >> 16)]++;
        }
        for (; i < stop; i++) sub[key_of(A->x[i]) >> 16]++;
        for (int j = 0; j < HBINS; j++) {
            h[j] += (int64_t)sub[j] + sub[HBINS + j] + sub[2 * HBINS + j] + sub[3 * HBINS + j];
            sub[j] = sub[HBINS + j] = sub[2 * HBINS + j] = sub[3 * HBINS + j] = 0;
        }
    }
    free(sub);
}

#if SDK_X86
/* Skips groups of 8 whose keys are all below the boundary bin (almost all of them for k << n);
 * returns the first index of a group that has one at or above it, or of the tail. */
AVX2 static int64_t tk_skip_avx2(const float *x, int64_t i, int64_t b, uint32_t bin) {
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), lim = _mm256_set1_epi32((int)bin - 1);
    for (; i + 8 <= b; i += 8) {
        __m256i k = _mm256_srli_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), absm), 16);
        if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(k, lim))) break;  /* keys < 2^15: signed compare is fine */
    }
    return i;
}
#endif

static void tk_pick_task(void *arg, int t, int nt) {
    tk_args *A = (tk_args *)arg;
    int64_t a, b;
    share(A->n, t, nt, 64, &a, &b);
    int64_t o = A->out_at[t], c = A->cand_at[t];
    uint32_t bin = (uint32_t)A->bin;
#if SDK_X86
    if (has_avx2() && bin > 0) {
        for (int64_t i = a; i < b;) {
            i = tk_skip_avx2(A->x, i, b, bin);
            int64_t stop = i + 8 < b ? i + 8 : b;
            for (; i < stop; i++) {
                uint32_t hb = key_of(A->x[i]) >> 16;
                if (hb > bin) { A->idx[o] = i; A->val[o++] = A->x[i]; }
                else if (hb == bin) A->cand[c++] = i;
            }
        }
        return;
    }
#endif
    for (int64_t i = a; i < b; i++) {
        uint32_t hb = key_of(A->x[i]) >> 16;
        if (hb > bin) { A->idx[o] = i; A->val[o++] = A->x[i]; }
        else if (hb == bin) A->cand[c++] = i;
    }
}

/* ---- top-k, sampled threshold ------------------------------------------------------------------
 *
 * For large vectors: a histogram of 256 evenly spread chunks of 1024 elements estimates a bin
 * b_lo safely below the k-th largest key; one SIMD pass then keeps only the elements whose bin is
 * >= b_lo (index and float bits, in index order), and the exact selection runs on those. The result is
 * exactly the full method's set: if at least k elements reach b_lo, every element of the top k
 * (which are all >= the k-th key >= b_lo) is among them. When fewer than k reach it, or more
 * than the buffers hold (a misleading sample), the caller falls back to the full histogram. */

#define TK_CHUNKS 256
#define TK_CHUNK 1024

typedef struct {
    const float *x;
    int64_t n, cap;  /* cap: candidates a thread may keep (its buffers hold cap + 8) */
    uint32_t bin;
    int64_t start[SDK_MAX_THREADS];
    uint32_t *cidx[SDK_MAX_THREADS];  /* index - start: shares are far below 2^32 elements */
    uint32_t *cbits[SDK_MAX_THREADS];  /* the candidates' float bits: no second, scattered read of x */
    int64_t count[SDK_MAX_THREADS];
    int overflow[SDK_MAX_THREADS];
} tks_args;

#if SDK_X86
static uint32_t tks_lut[256][8];  /* lane numbers of the set bits of a mask, packed to the left */
static pthread_once_t tks_once = PTHREAD_ONCE_INIT;
static void tks_init(void) {
    for (int m = 0; m < 256; m++)
        for (int l = 0, o = 0; l < 8; l++)
            if (m >> l & 1) tks_lut[m][o++] = (uint32_t)l;
}

/* Keeps the lanes whose bin is >= A->bin, 8 at a time, with no branch per element or group:
 * each group stores its kept lanes packed left, and c advances by their count. */
AVX2 static int64_t tks_avx2(const tks_args *A, int64_t i, int64_t b, uint32_t *ci, uint32_t *cb, int64_t *cp) {
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), lim = _mm256_set1_epi32((int)A->bin - 1);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t c = *cp, a = i;
    for (; i + 8 <= b; i += 8) {
        __m256i bits = _mm256_loadu_si256((const __m256i *)(A->x + i));
        __m256i key = _mm256_and_si256(bits, absm);
        int m = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_srli_epi32(key, 16), lim)));
        /* No branch on m: a group without candidates stores over the same slots (in L1) and
         * does not advance c; a branch here mispredicted on every group that has one. */
        if (c > A->cap) break;  /* full: the caller falls back */
        __m256i perm = _mm256_loadu_si256((const __m256i *)tks_lut[m]);
        __m256i at = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)(i - a)), lanes);
        _mm256_storeu_si256((__m256i *)(cb + c), _mm256_permutevar8x32_epi32(bits, perm));
        _mm256_storeu_si256((__m256i *)(ci + c), _mm256_permutevar8x32_epi32(at, perm));
        c += __builtin_popcount((unsigned)m);
    }
    *cp = c;
    return i;
}
#endif

static void tks_task(void *arg, int t, int nt) {
    tks_args *A = (tks_args *)arg;
    int64_t a, b, c = 0, i;
    share(A->n, t, nt, 64, &a, &b);
    A->start[t] = a;
    uint32_t *ci = A->cidx[t], *cb = A->cbits[t];
    i = a;
#if SDK_X86
    if (has_avx2()) i = tks_avx2(A, i, b, ci, cb, &c);
#endif
    for (; i < b && c <= A->cap; i++) {
        if (key_of(A->x[i]) >> 16 < A->bin) continue;
        ci[c] = (uint32_t)(i - a);
        cb[c++] = f2u(A->x[i]);
    }
    A->overflow[t] = c > A->cap || i < b;
    A->count[t] = c;
}

typedef struct {
    const tks_args *A;
    uint32_t lo, bin;
    int64_t width;  /* bins lo .. HBINS-1 */
    int64_t *hist[SDK_MAX_THREADS];  /* per thread, bin - lo */
    int64_t out_at[SDK_MAX_THREADS], edge_at[SDK_MAX_THREADS];
    int64_t *idx, *edge_idx;
    float *val;
    uint32_t *edge_bits;
} tksel_args;

static void tksel_hist_task(void *arg, int t, int nt) {
    (void)nt;
    tksel_args *S = (tksel_args *)arg;
    const uint32_t *cb = S->A->cbits[t];
    int64_t *h = S->hist[t];
    for (int64_t c = 0; c < S->A->count[t]; c++) h[((cb[c] & 0x7fffffff) >> 16) - S->lo]++;
}

static void tksel_pick_task(void *arg, int t, int nt) {
    (void)nt;
    tksel_args *S = (tksel_args *)arg;
    const tks_args *A = S->A;
    const uint32_t *cb = A->cbits[t], *ci = A->cidx[t];
    int64_t o = S->out_at[t], e = S->edge_at[t], base = A->start[t];
    for (int64_t c = 0; c < A->count[t]; c++) {
        uint32_t hb = (cb[c] & 0x7fffffff) >> 16;
        if (hb > S->bin) { S->idx[o] = base + ci[c]; S->val[o++] = u2f(cb[c]); }
        else if (hb == S->bin) { S->edge_idx[e] = base + ci[c]; S->edge_bits[e++] = cb[c]; }
    }
}

/* The top k of the candidates A holds (all with bin >= lo, at least k of them): 1, or -1 when
 * out of memory. Output order as the full method's: elements above the boundary bin in index
 * order, then the boundary bin's picks in index order (equal keys by index). */
static int tks_select(const tks_args *A, int nt, uint32_t lo, int64_t k, int64_t *idx, float *val) {
    tksel_args S;
    memset(&S, 0, sizeof S);
    S.A = A; S.lo = lo; S.width = HBINS - (int64_t)lo; S.idx = idx; S.val = val;
    int64_t *hists = (int64_t *)k_calloc((size_t)nt * (size_t)S.width, sizeof(int64_t));
    if (!hists) return -1;
    for (int t = 0; t < nt; t++) S.hist[t] = hists + (size_t)t * (size_t)S.width;
    parallel(nt, tksel_hist_task, &S);
    int64_t above, nedge;
    int64_t bin = tk_cut(S.hist, nt, lo, k, &above, S.out_at, S.edge_at, &nedge);
    free(hists);
    S.bin = (uint32_t)bin;
    S.edge_idx = (int64_t *)k_malloc((size_t)(nedge > 0 ? nedge : 1) * sizeof(int64_t));
    S.edge_bits = (uint32_t *)k_malloc((size_t)(nedge > 0 ? nedge : 1) * sizeof(uint32_t));
    int64_t *h2 = (int64_t *)k_calloc(65536, sizeof(int64_t));
    if (!S.edge_idx || !S.edge_bits || !h2) { free(S.edge_idx); free(S.edge_bits); free(h2); return -1; }
    parallel(nt, tksel_pick_task, &S);
    for (int64_t e = 0; e < nedge; e++) h2[S.edge_bits[e] & 0xffff]++;
    int64_t ties, low = tk_cut2(h2, k - above, &ties), o2 = above;
    for (int64_t e = 0; e < nedge; e++) {
        int64_t lk = S.edge_bits[e] & 0xffff;
        if (lk > low || (lk == low && ties-- > 0)) { idx[o2] = S.edge_idx[e]; val[o2++] = u2f(S.edge_bits[e]); }
    }
    free(S.edge_idx); free(S.edge_bits); free(h2);
    return 1;
}

/* 1: done; 0: fall back to the full method (nothing written to idx/val); -1: out of memory */
static int topk_sampled(const float *x, int64_t n, int64_t k, int64_t *idx, float *val) {
    int nt = threads_for(n);
    int64_t m = (int64_t)TK_CHUNKS * TK_CHUNK;
    /* aim at about 1.25 k candidates: the sample's rank of 1.25 k n/m, plus 4 sigma and a floor */
    double ks = (double)k * (double)m / (double)n;
    int64_t rank = (int64_t)(1.25 * ks + 4.0 * sqrt(ks) + 32.0);
    int64_t cap = (int64_t)(3.0 * (double)k / nt) + 4096;  /* per thread */
    uint32_t *h = (uint32_t *)k_calloc(HBINS, sizeof(uint32_t));
    uint32_t *ci = (uint32_t *)k_malloc((size_t)nt * (size_t)(cap + 8) * sizeof(uint32_t));
    uint32_t *cb = (uint32_t *)k_malloc((size_t)nt * (size_t)(cap + 8) * sizeof(uint32_t));
    if (!h || !ci || !cb) { free(h); free(ci); free(cb); return -1; }
    for (int c = 0; c < TK_CHUNKS; c++) {
        int64_t at = (int64_t)((double)c * (double)(n - TK_CHUNK) / (TK_CHUNKS - 1));
        for (int64_t i = at; i < at + TK_CHUNK; i++) h[key_of(x[i]) >> 16]++;
    }
    int64_t seen = 0, lo = HBINS - 1;
    for (; lo > 0; lo--) {
        seen += h[lo];
        if (seen >= rank) break;
    }
    tks_args A;
    memset(&A, 0, sizeof A);
    A.x = x; A.n = n; A.cap = cap; A.bin = (uint32_t)lo;
    for (int t = 0; t < nt; t++) { A.cidx[t] = ci + (size_t)t * (cap + 8); A.cbits[t] = cb + (size_t)t * (cap + 8); }
#if SDK_X86
    pthread_once(&tks_once, tks_init);
#endif
    parallel(nt, tks_task, &A);
    int64_t total = 0;
    int bad = 0;
    for (int t = 0; t < nt; t++) { total += A.count[t]; bad |= A.overflow[t]; }
    free(h);
    if (bad || total < k) { free(ci); free(cb); return 0; }
    /* Exact selection among the candidates, in parallel: each thread histograms its own (bins
     * >= lo only: every candidate's bin is), the boundary bin comes from their sums, and each
     * thread then writes its elements above that bin at its offset and copies its boundary
     * candidates to a shared list (thread order: index order). Only that short list is ranked
     * by its low 16 bits in one thread. */
    int rc = tks_select(&A, nt, (uint32_t)lo, k, idx, val);
    free(ci); free(cb);
    return rc;
}

int sdk_topk(const float *x, int64_t n, int64_t k, int64_t *idx, float *val) {
    if (k <= 0 || n <= 0) return 0;
    if (k > n) k = n;
    if (n >= SDK_PAR_MIN && n < ((int64_t)1 << 32) && k <= n / 32) {
        int rc = topk_sampled(x, n, k, idx, val);
        if (rc != 0) return rc == 1 ? 0 : -1;
    }
    int nt = threads_for(n);
    tk_args A;
    memset(&A, 0, sizeof A);
    A.x = x; A.n = n; A.k = k; A.idx = idx; A.val = val;
    int64_t *hists = (int64_t *)k_calloc((size_t)nt * HBINS, sizeof(int64_t));
    if (!hists) return -1;
    for (int t = 0; t < nt; t++) A.hist[t] = hists + (size_t)t * HBINS;
    parallel(nt, tk_hist_task, &A);
    int64_t above, ncand;
    int64_t bin = tk_cut(A.hist, nt, 0, k, &above, A.out_at, A.cand_at, &ncand);
    free(hists);
    A.bin = bin;
    A.cand = (int64_t *)k_malloc((size_t)(ncand > 0 ? ncand : 1) * sizeof(int64_t));
    if (!A.cand) return -1;
    parallel(nt, tk_pick_task, &A);
    /* level 2 over the candidates' low 16 bits; equal keys go by index (candidates are in order) */
    int64_t *h2 = (int64_t *)k_calloc(65536, sizeof(int64_t));
    if (!h2) { free(A.cand); return -1; }
    for (int64_t c = 0; c < ncand; c++) h2[key_of(x[A.cand[c]]) & 0xffff]++;
    int64_t ties, low = tk_cut2(h2, k - above, &ties), o = above;
    for (int64_t c = 0; c < ncand; c++) {
        int64_t i = A.cand[c];
        int64_t lk = key_of(x[i]) & 0xffff;
        if (lk > low || (lk == low && ties-- > 0)) { idx[o] = i; val[o++] = x[i]; }
    }
    free(h2);
    free(A.cand);
    return 0;
}

/* ---- PowerSGD's output: a rank-r product ------------------------------------------------------
 *
 * out = P Q^T over the rows x cols matrix whose first numel elements are stored, P rows x r and
 * Q cols x r row-major. torch's GEMM with an inner dimension of 4 runs at a fraction of memory
 * speed; this is one streaming write. Each element is s = p0 q0, then s = fma(pk, qk, s) for k
 * ascending: the same bits on the AVX2+FMA and scalar (fmaf) paths and for any thread count. */

typedef struct {
    const float *p, *qT;
    int64_t numel, rows, cols;
    int r;
    float *out;
    int sub;  /* out -= P Q^T (PowerSGD's residual, in place) instead of out = P Q^T */
    int stream;  /* non-temporal stores: a large output is not read back soon, skip the cache */
} lr_args;

static void lr_range_scalar(const lr_args *A, int64_t i, int64_t j0, int64_t j1) {
    const float *p = A->p + i * A->r;
    float *o = A->out + i * A->cols;
    for (int64_t j = j0; j < j1; j++) {
        float s = p[0] * A->qT[j];
        for (int k = 1; k < A->r; k++) s = fmaf(p[k], A->qT[k * A->cols + j], s);
        o[j] = A->sub ? o[j] - s : s;
    }
}

#if SDK_X86
/* Columns [j0, e) of a row (e - j0 a multiple of 8) at rank R, streamed to memory when ``stream``
 * (o + j0 then lies on a 32-byte boundary), else stored or, under A->sub, subtracted from ``out``.
 * Inlined with R a constant (4, 8) the row's factors stay in registers; R = 0 reads A->r. */
static inline __attribute__((always_inline)) AVX2FMA void lr_span_avx2(const lr_args *A, const float *p, float *o,
                                                                      int64_t j0, int64_t e, const int stream,
                                                                      const int R) {
    const int64_t C = A->cols;
    const int r = R ? R : A->r;
    __m256 pk[8];
    if (R)
        for (int k = 0; k < R; k++) pk[k] = _mm256_set1_ps(p[k]);
    for (int64_t j = j0; j < e; j += 8) {
        __m256 s = _mm256_mul_ps(R ? pk[0] : _mm256_broadcast_ss(p), _mm256_loadu_ps(A->qT + j));
        for (int k = 1; k < r; k++)
            s = _mm256_fmadd_ps(R ? pk[k] : _mm256_broadcast_ss(p + k), _mm256_loadu_ps(A->qT + k * C + j), s);
        if (stream) {
            _mm256_stream_ps(o + j, s);
            continue;
        }
        if (A->sub) s = _mm256_sub_ps(_mm256_loadu_ps(o + j), s);
        _mm256_storeu_ps(o + j, s);
    }
}

/* lr_span_avx2 with the rank made a constant where it is one of the common ones */
AVX2FMA static void lr_span_any_avx2(const lr_args *A, const float *p, float *o, int64_t j0, int64_t e,
                                     const int stream) {
    if (A->r == 4) {
        if (stream) lr_span_avx2(A, p, o, j0, e, 1, 4);
        else lr_span_avx2(A, p, o, j0, e, 0, 4);
    } else if (A->r == 8) {
        if (stream) lr_span_avx2(A, p, o, j0, e, 1, 8);
        else lr_span_avx2(A, p, o, j0, e, 0, 8);
    } else if (stream) {
        lr_span_avx2(A, p, o, j0, e, 1, 0);
    } else {
        lr_span_avx2(A, p, o, j0, e, 0, 0);
    }
}

AVX2FMA static void lr_row_avx2(const lr_args *A, int64_t i, int64_t len) {
    const float *p = A->p + i * A->r;
    float *o = A->out + i * A->cols;
    if (A->stream && !A->sub) {
        /* aligned non-temporal stores from the first 32-byte boundary (a plain store first reads
         * the line it writes); the head and tail round as the scalar path does, which is the
         * vector path's rounding */
        int64_t j0 = (int64_t)((32 - ((uintptr_t)o & 31)) & 31) / 4;
        if (j0 > len) j0 = len;
        lr_range_scalar(A, i, 0, j0);
        const int64_t e = j0 + ((len - j0) & ~(int64_t)7);
        lr_span_any_avx2(A, p, o, j0, e, 1);
        lr_range_scalar(A, i, e, len);
        return;
    }
    const int64_t end = len & ~(int64_t)7;
    lr_span_any_avx2(A, p, o, 0, end, 0);
    lr_range_scalar(A, i, end, len);
}
#endif

static void lr_task(void *arg, int t, int nt) {
    lr_args *A = (lr_args *)arg;
    int64_t a, b;
    share(A->rows, t, nt, 1, &a, &b);
    for (int64_t i = a; i < b; i++) {
        int64_t left = A->numel - i * A->cols, len = left < A->cols ? left : A->cols;
        if (len <= 0) break;
#if SDK_X86
        if (has_fma()) { lr_row_avx2(A, i, len); continue; }
#endif
        lr_range_scalar(A, i, 0, len);
    }
#if SDK_X86
    if (A->stream) _mm_sfence();  /* this thread's streamed stores land before it reports done */
#endif
}

#define LR_STREAM_MIN (1 << 18)  /* 1 MB of output */

static int lowrank(const float *p, const float *q, int64_t numel, int64_t rows, int64_t cols, int r,
                   float *out, int sub) {
    if (numel <= 0) return 0;
    float *qT = (float *)k_malloc((size_t)r * (size_t)cols * sizeof(float));
    if (!qT) return -1;
    for (int64_t j = 0; j < cols; j++)
        for (int k = 0; k < r; k++) qT[k * cols + j] = q[j * r + k];
    lr_args A = {p, qT, numel, rows, cols, r, out, sub, !sub && numel >= LR_STREAM_MIN};
    parallel(threads_for(numel), lr_task, &A);
    free(qT);
    return 0;
}

int sdk_lowrank_product(const float *p, const float *q, int64_t numel, int64_t rows, int64_t cols, int r,
                        float *out) {
    return lowrank(p, q, numel, rows, cols, r, out, 0);
}

/* m -= P Q^T in place, each product rounded as in sdk_lowrank_product: PowerSGD's residual
 * e = M - P Qw^T in one read and one write of M, where torch's addmm_ at k = r is far slower. */
int sdk_lowrank_subtract(const float *p, const float *q, int64_t numel, int64_t rows, int64_t cols, int r,
                         float *m) {
    return lowrank(p, q, numel, rows, cols, r, m, 1);
}

/* ---- PowerSGD's two passes over M -------------------------------------------------------------
 *
 * A round reads M = e + scale G twice: for P = M Q before the first all-reduce and for
 * Qw = M^T P^ after it. The residual e = M - P^ Qw^T is kept as M and its two factors and
 * subtracted by the next round's first pass, which also adds the new gradient and projects:
 * one read of G and one read and write of M where the eager form costs three passes.
 *
 * Dot products run in 8 lanes (element j goes to lane j % 8 for j below the row's last multiple
 * of 8), the lanes are summed in a fixed tree, then the tail is added by fma in order: the same
 * bits on the AVX2 and scalar paths and for any thread count. */

static float lanes_sum(const float *l) {
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

typedef struct {
    const float *g;
    float scale;
    float *m;
    int mode;  /* 0: M = scale G; 1: M += scale G; 2: M = (M - Pe Qe^T) + scale G */
    const float *pe, *qeT, *qT;
    int r;
    int64_t numel, rows, cols;
    float *pt;  /* r x rows: P^T */
} pj_args;

static void pj_update_scalar(const pj_args *A, int64_t i, int64_t j0, int64_t j1) {
    const float *g = A->g + i * A->cols, *pe = A->pe + i * A->r;
    float *m = A->m + i * A->cols;
    for (int64_t j = j0; j < j1; j++) {
        float x;
        if (A->mode == 0) {
            x = A->scale * g[j];
        } else {
            x = m[j];
            if (A->mode == 2) {
                float s = pe[0] * A->qeT[j];
                for (int k = 1; k < A->r; k++) s = fmaf(pe[k], A->qeT[k * A->cols + j], s);
                x = x - s;
            }
            x = fmaf(A->scale, g[j], x);
        }
        m[j] = x;
    }
}

static float dot_scalar(const float *x, const float *y, int64_t len) {
    const int64_t end = len & ~(int64_t)7;
    float l[8] = {0};
    for (int64_t j = 0; j < end; j++) l[j & 7] = fmaf(x[j], y[j], l[j & 7]);
    float s = lanes_sum(l);
    for (int64_t j = end; j < len; j++) s = fmaf(x[j], y[j], s);
    return s;
}

#if SDK_X86
AVX2FMA static void pj_update_avx2(const pj_args *A, int64_t i, int64_t len) {
    const int64_t C = A->cols, end = len & ~(int64_t)7;
    const float *g = A->g + i * C, *pe = A->pe + i * A->r;
    float *m = A->m + i * C;
    const __m256 sc = _mm256_set1_ps(A->scale);
    if (A->mode == 0) {
        for (int64_t j = 0; j < end; j += 8) _mm256_storeu_ps(m + j, _mm256_mul_ps(sc, _mm256_loadu_ps(g + j)));
    } else if (A->mode == 1) {
        for (int64_t j = 0; j < end; j += 8)
            _mm256_storeu_ps(m + j, _mm256_fmadd_ps(sc, _mm256_loadu_ps(g + j), _mm256_loadu_ps(m + j)));
    } else if (A->r == 4) {
        const __m256 p0 = _mm256_set1_ps(pe[0]), p1 = _mm256_set1_ps(pe[1]), p2 = _mm256_set1_ps(pe[2]);
        const __m256 p3 = _mm256_set1_ps(pe[3]);
        const float *q0 = A->qeT, *q1 = q0 + C, *q2 = q1 + C, *q3 = q2 + C;
        for (int64_t j = 0; j < end; j += 8) {
            __m256 s = _mm256_mul_ps(p0, _mm256_loadu_ps(q0 + j));
            s = _mm256_fmadd_ps(p1, _mm256_loadu_ps(q1 + j), s);
            s = _mm256_fmadd_ps(p2, _mm256_loadu_ps(q2 + j), s);
            s = _mm256_fmadd_ps(p3, _mm256_loadu_ps(q3 + j), s);
            __m256 x = _mm256_sub_ps(_mm256_loadu_ps(m + j), s);
            _mm256_storeu_ps(m + j, _mm256_fmadd_ps(sc, _mm256_loadu_ps(g + j), x));
        }
    } else if (A->r == 8) {  /* the default rank: the row's eight factors in registers */
        __m256 pk[8];
        for (int k = 0; k < 8; k++) pk[k] = _mm256_set1_ps(pe[k]);
        for (int64_t j = 0; j < end; j += 8) {
            __m256 s = _mm256_mul_ps(pk[0], _mm256_loadu_ps(A->qeT + j));
            for (int k = 1; k < 8; k++) s = _mm256_fmadd_ps(pk[k], _mm256_loadu_ps(A->qeT + k * C + j), s);
            __m256 x = _mm256_sub_ps(_mm256_loadu_ps(m + j), s);
            _mm256_storeu_ps(m + j, _mm256_fmadd_ps(sc, _mm256_loadu_ps(g + j), x));
        }
    } else {
        for (int64_t j = 0; j < end; j += 8) {
            __m256 s = _mm256_mul_ps(_mm256_set1_ps(pe[0]), _mm256_loadu_ps(A->qeT + j));
            for (int k = 1; k < A->r; k++)
                s = _mm256_fmadd_ps(_mm256_set1_ps(pe[k]), _mm256_loadu_ps(A->qeT + k * C + j), s);
            __m256 x = _mm256_sub_ps(_mm256_loadu_ps(m + j), s);
            _mm256_storeu_ps(m + j, _mm256_fmadd_ps(sc, _mm256_loadu_ps(g + j), x));
        }
    }
    pj_update_scalar(A, i, end, len);
}

/* r = 4: the update and the four dots in one loop, M never reloaded. */
static inline __attribute__((always_inline)) AVX2FMA void pj_row4_avx2(const pj_args *A, int64_t i, int64_t len,
                                                                      const int mode) {
    const int64_t C = A->cols, end = len & ~(int64_t)7;
    const float *g = A->g + i * C, *pe = A->pe + i * 4;
    float *m = A->m + i * C;
    const __m256 sc = _mm256_set1_ps(A->scale);
    const float *q0 = A->qT, *q1 = q0 + C, *q2 = q1 + C, *q3 = q2 + C;
    const float *e0 = A->qeT, *e1 = e0 + C, *e2 = e1 + C, *e3 = e2 + C;
    __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
    if (mode == 2) {
        p0 = _mm256_set1_ps(pe[0]), p1 = _mm256_set1_ps(pe[1]), p2 = _mm256_set1_ps(pe[2]);
        p3 = _mm256_set1_ps(pe[3]);
    }
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < end; j += 8) {
        __m256 x;
        if (mode == 0) {
            x = _mm256_mul_ps(sc, _mm256_loadu_ps(g + j));
        } else if (mode == 1) {
            x = _mm256_fmadd_ps(sc, _mm256_loadu_ps(g + j), _mm256_loadu_ps(m + j));
        } else {
            __m256 s = _mm256_mul_ps(p0, _mm256_loadu_ps(e0 + j));
            s = _mm256_fmadd_ps(p1, _mm256_loadu_ps(e1 + j), s);
            s = _mm256_fmadd_ps(p2, _mm256_loadu_ps(e2 + j), s);
            s = _mm256_fmadd_ps(p3, _mm256_loadu_ps(e3 + j), s);
            x = _mm256_fmadd_ps(sc, _mm256_loadu_ps(g + j), _mm256_sub_ps(_mm256_loadu_ps(m + j), s));
        }
        _mm256_storeu_ps(m + j, x);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(q0 + j), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(q1 + j), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(q2 + j), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(q3 + j), a3);
    }
    pj_update_scalar(A, i, end, len);
    float l[4][8];
    _mm256_storeu_ps(l[0], a0);
    _mm256_storeu_ps(l[1], a1);
    _mm256_storeu_ps(l[2], a2);
    _mm256_storeu_ps(l[3], a3);
    const float *qk[4] = {q0, q1, q2, q3};
    for (int k = 0; k < 4; k++) {
        float sum = lanes_sum(l[k]);
        for (int64_t j = end; j < len; j++) sum = fmaf(m[j], qk[k][j], sum);
        A->pt[(int64_t)k * A->rows + i] = sum;
    }
}

/* Software prefetch distance (floats) for the streamed rows: the hardware prefetcher alone left
 * these loops at ~60% of the speed they reach with it on the dev VM (AMD EPYC). */
#define PJ_PF 1024

/* Two full rows at once: Q's and Qe's columns are loaded once for both, and eight independent
 * sums hide the FMA latency. Each row rounds exactly as pj_row4_avx2 would. */
static inline __attribute__((always_inline)) AVX2FMA void pj_pair4_avx2(const pj_args *A, int64_t i,
                                                                       const int mode) {
    const int64_t C = A->cols, end = C & ~(int64_t)7;
    const float *g = A->g + i * C, *h = g + C, *pe = A->pe + i * 4;
    float *m = A->m + i * C, *n = m + C;
    const __m256 sc = _mm256_set1_ps(A->scale);
    const float *q0 = A->qT, *q1 = q0 + C, *q2 = q1 + C, *q3 = q2 + C;
    const float *e0 = A->qeT, *e1 = e0 + C, *e2 = e1 + C, *e3 = e2 + C;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t j = 0; j < end; j += 8) {
        __m256 x, y;
        _mm_prefetch((const char *)(g + j + PJ_PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(h + j + PJ_PF), _MM_HINT_T0);
        if (mode) {
            _mm_prefetch((const char *)(m + j + PJ_PF), _MM_HINT_T0);
            _mm_prefetch((const char *)(n + j + PJ_PF), _MM_HINT_T0);
        }
        if (mode == 0) {
            x = _mm256_mul_ps(sc, _mm256_loadu_ps(g + j));
            y = _mm256_mul_ps(sc, _mm256_loadu_ps(h + j));
        } else if (mode == 1) {
            x = _mm256_fmadd_ps(sc, _mm256_loadu_ps(g + j), _mm256_loadu_ps(m + j));
            y = _mm256_fmadd_ps(sc, _mm256_loadu_ps(h + j), _mm256_loadu_ps(n + j));
        } else {
            const __m256 f0 = _mm256_loadu_ps(e0 + j), f1 = _mm256_loadu_ps(e1 + j);
            const __m256 f2 = _mm256_loadu_ps(e2 + j), f3 = _mm256_loadu_ps(e3 + j);
            __m256 s = _mm256_mul_ps(_mm256_broadcast_ss(pe), f0);
            s = _mm256_fmadd_ps(_mm256_broadcast_ss(pe + 1), f1, s);
            s = _mm256_fmadd_ps(_mm256_broadcast_ss(pe + 2), f2, s);
            s = _mm256_fmadd_ps(_mm256_broadcast_ss(pe + 3), f3, s);
            __m256 t = _mm256_mul_ps(_mm256_broadcast_ss(pe + 4), f0);
            t = _mm256_fmadd_ps(_mm256_broadcast_ss(pe + 5), f1, t);
            t = _mm256_fmadd_ps(_mm256_broadcast_ss(pe + 6), f2, t);
            t = _mm256_fmadd_ps(_mm256_broadcast_ss(pe + 7), f3, t);
            x = _mm256_fmadd_ps(sc, _mm256_loadu_ps(g + j), _mm256_sub_ps(_mm256_loadu_ps(m + j), s));
            y = _mm256_fmadd_ps(sc, _mm256_loadu_ps(h + j), _mm256_sub_ps(_mm256_loadu_ps(n + j), t));
        }
        _mm256_storeu_ps(m + j, x);
        _mm256_storeu_ps(n + j, y);
        const __m256 c0 = _mm256_loadu_ps(q0 + j), c1 = _mm256_loadu_ps(q1 + j);
        const __m256 c2 = _mm256_loadu_ps(q2 + j), c3 = _mm256_loadu_ps(q3 + j);
        a0 = _mm256_fmadd_ps(x, c0, a0);
        a1 = _mm256_fmadd_ps(x, c1, a1);
        a2 = _mm256_fmadd_ps(x, c2, a2);
        a3 = _mm256_fmadd_ps(x, c3, a3);
        b0 = _mm256_fmadd_ps(y, c0, b0);
        b1 = _mm256_fmadd_ps(y, c1, b1);
        b2 = _mm256_fmadd_ps(y, c2, b2);
        b3 = _mm256_fmadd_ps(y, c3, b3);
    }
    pj_update_scalar(A, i, end, C);
    pj_update_scalar(A, i + 1, end, C);
    float l[8][8];
    _mm256_storeu_ps(l[0], a0);
    _mm256_storeu_ps(l[1], a1);
    _mm256_storeu_ps(l[2], a2);
    _mm256_storeu_ps(l[3], a3);
    _mm256_storeu_ps(l[4], b0);
    _mm256_storeu_ps(l[5], b1);
    _mm256_storeu_ps(l[6], b2);
    _mm256_storeu_ps(l[7], b3);
    const float *qk[4] = {q0, q1, q2, q3};
    for (int u = 0; u < 2; u++) {
        const float *row = m + u * C;
        for (int k = 0; k < 4; k++) {
            float sum = lanes_sum(l[4 * u + k]);
            for (int64_t j = end; j < C; j++) sum = fmaf(row[j], qk[k][j], sum);
            A->pt[(int64_t)k * A->rows + i + u] = sum;
        }
    }
}

AVX2FMA static void pj_pair4_avx2_mode(const pj_args *A, int64_t i) {
    if (A->mode == 0) pj_pair4_avx2(A, i, 0);
    else if (A->mode == 1) pj_pair4_avx2(A, i, 1);
    else pj_pair4_avx2(A, i, 2);
}

AVX2FMA static void pj_row4_avx2_mode(const pj_args *A, int64_t i, int64_t len) {
    if (A->mode == 0) pj_row4_avx2(A, i, len, 0);
    else if (A->mode == 1) pj_row4_avx2(A, i, len, 1);
    else pj_row4_avx2(A, i, len, 2);
}

/* Up to four dot products of x with y[0..kn), lanes as dot_scalar. */
AVX2FMA static void dots_avx2(const float *x, const float *const *y, int kn, int64_t len, float *out) {
    const int64_t end = len & ~(int64_t)7;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    if (kn == 4) {
        for (int64_t j = 0; j < end; j += 8) {
            const __m256 v = _mm256_loadu_ps(x + j);
            a0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(y[0] + j), a0);
            a1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(y[1] + j), a1);
            a2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(y[2] + j), a2);
            a3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(y[3] + j), a3);
        }
    } else {
        for (int64_t j = 0; j < end; j += 8) {
            const __m256 v = _mm256_loadu_ps(x + j);
            a0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(y[0] + j), a0);
            if (kn > 1) a1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(y[1] + j), a1);
            if (kn > 2) a2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(y[2] + j), a2);
        }
    }
    float l[4][8];
    _mm256_storeu_ps(l[0], a0);
    _mm256_storeu_ps(l[1], a1);
    _mm256_storeu_ps(l[2], a2);
    _mm256_storeu_ps(l[3], a3);
    for (int k = 0; k < kn; k++) {
        float s = lanes_sum(l[k]);
        for (int64_t j = end; j < len; j++) s = fmaf(x[j], y[k][j], s);
        out[k] = s;
    }
}
#endif

static void pj_task(void *arg, int t, int nt) {
    pj_args *A = (pj_args *)arg;
    int64_t a, b;
    share(A->rows, t, nt, 1, &a, &b);
    for (int64_t i = a; i < b; i++) {
        int64_t left = A->numel - i * A->cols, len = left < A->cols ? left : A->cols;
        if (len < 0) len = 0;  /* rows past numel are zeros: their dots are 0 */
        const float *row = A->m + i * A->cols;
#if SDK_X86
        if (has_fma() && A->r == 4) {
            if (i + 1 < b && (i + 2) * A->cols <= A->numel) {
                pj_pair4_avx2_mode(A, i++);
                continue;
            }
            pj_row4_avx2_mode(A, i, len);
            continue;
        }
        if (has_fma()) {
            pj_update_avx2(A, i, len);
            for (int k = 0; k < A->r; k += 4) {
                const float *y[4];
                float d[4];
                int kn = A->r - k < 4 ? A->r - k : 4;
                for (int u = 0; u < kn; u++) y[u] = A->qT + (int64_t)(k + u) * A->cols;
                dots_avx2(row, y, kn, len, d);
                for (int u = 0; u < kn; u++) A->pt[(int64_t)(k + u) * A->rows + i] = d[u];
            }
            continue;
        }
#endif
        pj_update_scalar(A, i, 0, len);
        for (int k = 0; k < A->r; k++)
            A->pt[(int64_t)k * A->rows + i] = dot_scalar(row, A->qT + (int64_t)k * A->cols, len);
    }
}

static float *transposed(const float *q, int64_t cols, int r) {
    float *qT = (float *)k_malloc((size_t)r * (size_t)cols * sizeof(float));
    if (qT)
        for (int64_t j = 0; j < cols; j++)
            for (int k = 0; k < r; k++) qT[k * cols + j] = q[j * r + k];
    return qT;
}

int sdk_powersgd_project(const float *g, float scale, float *m, int mode, const float *pe, const float *qe,
                         const float *q, int64_t numel, int64_t rows, int64_t cols, int r, float *pt) {
    float *qT = transposed(q, cols, r), *qeT = mode == 2 ? transposed(qe, cols, r) : NULL;
    if (!qT || (mode == 2 && !qeT)) {
        free(qT);
        free(qeT);
        return -1;
    }
    pj_args A = {g, scale, m, mode, pe, qeT, qT, r, numel, rows, cols, pt};
    parallel(threads_for(numel), pj_task, &A);
    free(qT);
    free(qeT);
    return 0;
}

/* Qw^T = P^T M (r x cols), M's rows streamed once, two at a time, into sums held in cache
 * (r x cols floats); columns are split across threads and each sum runs over the rows in
 * order (fma from zero), so the bits do not depend on threads or paths. */

typedef struct {
    const float *p, *m;
    int64_t numel, rows, cols;
    int r;
    float *qt;
} bp_args;

/* Rows [i0, rows) one at a time over columns [j0, j1), each row only up to numel. */
static void bp_rows_scalar(const bp_args *A, int64_t i0, int64_t j0, int64_t j1) {
    for (int64_t i = i0; i < A->rows; i++) {
        int64_t left = A->numel - i * A->cols, e = left < j1 ? left : j1;
        const float *row = A->m + i * A->cols;
        for (int k = 0; k < A->r; k++) {
            const float pk = A->p[i * A->r + k];
            float *acc = A->qt + k * A->cols;
            for (int64_t j = j0; j < e; j++) acc[j] = fmaf(pk, row[j], acc[j]);
        }
    }
}

#if SDK_X86
/* Full rows [0, full), four at a time (a quarter of the sums' cache traffic per element), into the
 * sums [k0, k0 + nk) (nk <= 4) of a rank-R P: any rank, in blocks of four sums, one pass over M per
 * block, each sum's fma order that of the scalar path; returns the first row not done. */
AVX2FMA static int64_t bp_block_avx2(const bp_args *A, int64_t full, int64_t j0, int64_t j1, int k0, int nk,
                                     int64_t R) {
    const int64_t C = A->cols, end = j0 + ((j1 - j0) & ~(int64_t)7);
    int64_t i = 0;
    for (; i + 4 <= full; i += 4) {
        const float *x = A->m + i * C, *y = x + C, *z = y + C, *w = z + C, *p = A->p + i * R + k0;
        for (int64_t j = j0; j < end; j += 8) {
            _mm_prefetch((const char *)(x + j + PJ_PF), _MM_HINT_T0);
            _mm_prefetch((const char *)(y + j + PJ_PF), _MM_HINT_T0);
            _mm_prefetch((const char *)(z + j + PJ_PF), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + j + PJ_PF), _MM_HINT_T0);
            const __m256 u = _mm256_loadu_ps(x + j), v = _mm256_loadu_ps(y + j);
            const __m256 c = _mm256_loadu_ps(z + j), d = _mm256_loadu_ps(w + j);
            for (int k = 0; k < nk; k++) {
                float *s = A->qt + (k0 + k) * C + j;
                _mm256_storeu_ps(s, _mm256_fmadd_ps(_mm256_broadcast_ss(p + 3 * R + k), d,
                    _mm256_fmadd_ps(_mm256_broadcast_ss(p + 2 * R + k), c,
                    _mm256_fmadd_ps(_mm256_broadcast_ss(p + R + k), v,
                    _mm256_fmadd_ps(_mm256_broadcast_ss(p + k), u, _mm256_loadu_ps(s))))));
            }
        }
        for (int64_t j = end; j < j1; j++)
            for (int k = 0; k < nk; k++) {
                float *s = A->qt + (k0 + k) * C + j;
                *s = fmaf(p[3 * R + k], w[j], fmaf(p[2 * R + k], z[j], fmaf(p[R + k], y[j], fmaf(p[k], x[j], *s))));
            }
    }
    return i;
}

/* Full rows [0, full), r = 4: four at a time (flattened, so R and nk are constants there), then a
 * pair; returns the first row not done. */
AVX2FMA __attribute__((flatten)) static int64_t bp_pairs4_avx2(const bp_args *A, int64_t full, int64_t j0,
                                                               int64_t j1) {
    const int64_t C = A->cols, end = j0 + ((j1 - j0) & ~(int64_t)7);
    float *s0 = A->qt, *s1 = s0 + C, *s2 = s1 + C, *s3 = s2 + C;
    int64_t i = bp_block_avx2(A, full, j0, j1, 0, 4, 4);
    for (; i + 2 <= full; i += 2) {
        const float *x = A->m + i * C, *y = x + C, *p = A->p + i * 4;
        const __m256 a0 = _mm256_set1_ps(p[0]), a1 = _mm256_set1_ps(p[1]), a2 = _mm256_set1_ps(p[2]);
        const __m256 a3 = _mm256_set1_ps(p[3]), b0 = _mm256_set1_ps(p[4]), b1 = _mm256_set1_ps(p[5]);
        const __m256 b2 = _mm256_set1_ps(p[6]), b3 = _mm256_set1_ps(p[7]);
        for (int64_t j = j0; j < end; j += 8) {
            const __m256 u = _mm256_loadu_ps(x + j), v = _mm256_loadu_ps(y + j);
            _mm256_storeu_ps(s0 + j, _mm256_fmadd_ps(b0, v, _mm256_fmadd_ps(a0, u, _mm256_loadu_ps(s0 + j))));
            _mm256_storeu_ps(s1 + j, _mm256_fmadd_ps(b1, v, _mm256_fmadd_ps(a1, u, _mm256_loadu_ps(s1 + j))));
            _mm256_storeu_ps(s2 + j, _mm256_fmadd_ps(b2, v, _mm256_fmadd_ps(a2, u, _mm256_loadu_ps(s2 + j))));
            _mm256_storeu_ps(s3 + j, _mm256_fmadd_ps(b3, v, _mm256_fmadd_ps(a3, u, _mm256_loadu_ps(s3 + j))));
        }
        for (int64_t j = end; j < j1; j++) {
            s0[j] = fmaf(p[4], y[j], fmaf(p[0], x[j], s0[j]));
            s1[j] = fmaf(p[5], y[j], fmaf(p[1], x[j], s1[j]));
            s2[j] = fmaf(p[6], y[j], fmaf(p[2], x[j], s2[j]));
            s3[j] = fmaf(p[7], y[j], fmaf(p[3], x[j], s3[j]));
        }
    }
    return i;
}
#endif

static void bp_task(void *arg, int t, int nt) {
    bp_args *A = (bp_args *)arg;
    int64_t j0, j1;
    share(A->cols, t, nt, 16, &j0, &j1);
    if (j0 >= j1) return;
    for (int k = 0; k < A->r; k++) memset(A->qt + k * A->cols + j0, 0, (size_t)(j1 - j0) * sizeof(float));
    int64_t i = 0;
#if SDK_X86
    if (has_fma() && A->r == 4) {
        i = bp_pairs4_avx2(A, A->numel / A->cols, j0, j1);
    } else if (has_fma()) {  /* every other rank: the scalar path is a libm fmaf call per element here */
        for (int k0 = 0; k0 < A->r; k0 += 4)
            i = bp_block_avx2(A, A->numel / A->cols, j0, j1, k0, A->r - k0 < 4 ? A->r - k0 : 4, A->r);
    }
#endif
    bp_rows_scalar(A, i, j0, j1);
}

void sdk_powersgd_back(const float *p, const float *m, int64_t numel, int64_t rows, int64_t cols, int r,
                       float *qt) {
    bp_args A = {p, m, numel, rows, cols, r, qt};
    parallel(threads_for(numel), bp_task, &A);
}

/* ---- training feedback ------------------------------------------------------------------------ */

/* torch rounds a + alpha * b (add and sub with alpha) as one fma where its CPU kernels run AVX2
 * code, which they do on every CPU with AVX2 and FMA, and as a multiply then an add elsewhere:
 * these passes follow the CPU, not force_scalar, to give torch's bits on both paths. */
static int torch_fuses(void) {
#if SDK_X86
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static inline float mul_add(float c, float b, float a, int fused) { return fused ? fmaf(c, b, a) : a + c * b; }

typedef struct {
    const float *g, *d, *v;
    float *out, *r, *vout;
    float c;
    int64_t n;
    int fused;
    int flags[SDK_MAX_THREADS];  /* sdk_feedback_after: thread t's share held an inf or NaN */
} fb_args;

/* The element loops: the scalar path, and the AVX2 loops' tails (where fused is set). */
static void fb_before_range(const fb_args *A, int64_t a, int64_t b) {
    for (int64_t i = a; i < b; i++) {
        float x = A->d ? A->g[i] / A->d[i] : A->g[i];
        A->out[i] = A->v ? mul_add(A->c, A->v[i], x, A->fused) : x;
    }
}

static int fb_after_range(const fb_args *A, int64_t a, int64_t b) {
    int bad = 0;
    for (int64_t i = a; i < b; i++) {
        float x = A->r[i];
        A->vout[i] = x;
        bad |= !isfinite(x);
        if (A->v) x = mul_add(-A->c, A->v[i], x, A->fused);
        if (A->d) x *= A->d[i];
        A->r[i] = x;
    }
    return bad;
}

#if SDK_X86
AVX2FMA static void fb_before_avx2(fb_args *A, int64_t a, int64_t b) {
    const __m256 c = _mm256_set1_ps(A->c);
    for (; a + 8 <= b; a += 8) {
        __m256 x = _mm256_loadu_ps(A->g + a);
        if (A->d) x = _mm256_div_ps(x, _mm256_loadu_ps(A->d + a));
        if (A->v) x = _mm256_fmadd_ps(c, _mm256_loadu_ps(A->v + a), x);
        _mm256_storeu_ps(A->out + a, x);
    }
    fb_before_range(A, a, b);
}

AVX2FMA static int fb_after_avx2(fb_args *A, int64_t a, int64_t b) {
    const __m256 c = _mm256_set1_ps(-A->c), zero = _mm256_setzero_ps();
    __m256 probe = zero;  /* x * 0 is 0 for finite x and NaN for inf or NaN */
    for (; a + 8 <= b; a += 8) {
        __m256 x = _mm256_loadu_ps(A->r + a);
        _mm256_storeu_ps(A->vout + a, x);
        probe = _mm256_add_ps(probe, _mm256_mul_ps(x, zero));
        if (A->v) x = _mm256_fmadd_ps(c, _mm256_loadu_ps(A->v + a), x);
        if (A->d) x = _mm256_mul_ps(x, _mm256_loadu_ps(A->d + a));
        _mm256_storeu_ps(A->r + a, x);
    }
    float p[8];
    _mm256_storeu_ps(p, probe);
    int bad = 0;
    for (int k = 0; k < 8; k++) bad |= p[k] != 0.0f;
    return bad | fb_after_range(A, a, b);
}
#endif

static void fb_before_task(void *arg, int t, int nt) {
    fb_args *A = (fb_args *)arg;
    int64_t a, b;
    share(A->n, t, nt, 64, &a, &b);
#if SDK_X86
    if (A->fused && has_avx2()) { fb_before_avx2(A, a, b); return; }
#endif
    fb_before_range(A, a, b);
}

static void fb_after_task(void *arg, int t, int nt) {
    fb_args *A = (fb_args *)arg;
    int64_t a, b;
    share(A->n, t, nt, 64, &a, &b);
#if SDK_X86
    if (A->fused && has_avx2()) { A->flags[t] = fb_after_avx2(A, a, b); return; }
#endif
    A->flags[t] = fb_after_range(A, a, b);
}

void sdk_feedback_before(const float *g, const float *d, const float *v, float c, float *out, int64_t n) {
    if (n <= 0) return;
    fb_args A = {.g = g, .d = d, .v = v, .out = out, .c = c, .n = n, .fused = torch_fuses()};
    parallel(threads_for(n), fb_before_task, &A);
}

int sdk_feedback_after(float *r, const float *prev, float c, const float *d, float *v_out, int64_t n) {
    if (n <= 0) return 1;
    int nt = threads_for(n);
    fb_args A = {.r = r, .v = prev, .d = d, .vout = v_out, .c = c, .n = n, .fused = torch_fuses()};
    parallel(nt, fb_after_task, &A);
    for (int t = 0; t < nt; t++)
        if (A.flags[t]) return 0;
    return 1;
}
