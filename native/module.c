/* spark_dl._native: the kernels of kernels.c for Python, on raw memory.
 *
 * Arrays arrive as (address, count) integers, e.g. tensor.data_ptr(): no torch headers and no
 * libtorch, so one build serves every torch version and no tensor is copied. The Python wrapper
 * (spark_dl/compression/native.py) checks dtypes, contiguity and sizes before calling; here an
 * address is trusted. Each kernel runs with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"

#define PTR(T, v) ((T)(uintptr_t)(v))

/* -1 from a kernel: memory ran out before it wrote anything. */
static PyObject *no_memory(const char *kernel) {
    PyErr_Format(PyExc_MemoryError, "spark_dl._native.%s: out of memory (nothing was written; free memory, "
                 "or run the torch path with SPARK_DL_NATIVE=0)", kernel);
    return NULL;
}

static PyObject *onebit_encode(PyObject *self, PyObject *args) {
    unsigned long long g, e_in, pending, e_out, means, bits;
    long long n, bucket;
    int defer, rc;
    float div;
    if (!PyArg_ParseTuple(args, "KKKKpLLKKf", &g, &e_in, &pending, &e_out, &defer, &n, &bucket, &means, &bits, &div))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = sdk_onebit_encode(PTR(const float *, g), PTR(const float *, e_in), PTR(const float *, pending),
                           PTR(float *, e_out), defer, n, bucket, PTR(float *, means), PTR(uint8_t *, bits), div);
    Py_END_ALLOW_THREADS
    if (rc == -2) {
        PyErr_SetString(PyExc_ValueError, "onebit_encode: a pending residual needs defer and e_out");
        return NULL;
    }
    if (rc) return no_memory("onebit_encode");
    Py_RETURN_NONE;
}

static PyObject *onebit_decode(PyObject *self, PyObject *args) {
    unsigned long long means, bits, out;
    long long n, bucket;
    int acc, rc;
    if (!PyArg_ParseTuple(args, "KKLLKp", &means, &bits, &n, &bucket, &out, &acc)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = sdk_onebit_decode(PTR(const float *, means), PTR(const uint8_t *, bits), n, bucket, PTR(float *, out), acc);
    Py_END_ALLOW_THREADS
    if (rc) return no_memory("onebit_decode");
    Py_RETURN_NONE;
}

static PyObject *scaled_sign_encode(PyObject *self, PyObject *args) {
    unsigned long long g, e_in, pending, p_out, bits, scales;
    long long n, bucket;
    float div;
    int rc;
    if (!PyArg_ParseTuple(args, "KKKKLLKKf", &g, &e_in, &pending, &p_out, &n, &bucket, &bits, &scales, &div))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = sdk_scaled_sign_encode(PTR(const float *, g), PTR(const float *, e_in), PTR(const float *, pending),
                                PTR(float *, p_out), n, bucket, PTR(uint8_t *, bits), PTR(float *, scales), div);
    Py_END_ALLOW_THREADS
    if (rc) return no_memory("scaled_sign_encode");
    Py_RETURN_NONE;
}

static PyObject *scaled_sign_decode(PyObject *self, PyObject *args) {
    unsigned long long scales, bits, out;
    long long n, bucket;
    int acc, rc;
    if (!PyArg_ParseTuple(args, "KKLLKp", &scales, &bits, &n, &bucket, &out, &acc)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = sdk_scaled_sign_decode(PTR(const float *, scales), PTR(const uint8_t *, bits), n, bucket, PTR(float *, out),
                                acc);
    Py_END_ALLOW_THREADS
    if (rc) return no_memory("scaled_sign_decode");
    Py_RETURN_NONE;
}

/* kind: "f16" or "bf16"; to_half: 1 for float32 -> half (times scale), 0 for half -> float32. */
static PyObject *convert(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    long long n;
    float scale;
    int bf16, to_half, accumulate = 0;
    if (!PyArg_ParseTuple(args, "KKLfpp|p", &src, &dst, &n, &scale, &bf16, &to_half, &accumulate)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (to_half && bf16) sdk_f32_to_bf16(PTR(const float *, src), PTR(uint16_t *, dst), n, scale);
    else if (to_half) sdk_f32_to_f16(PTR(const float *, src), PTR(uint16_t *, dst), n, scale);
    else if (bf16) sdk_bf16_to_f32(PTR(const uint16_t *, src), PTR(float *, dst), n, accumulate);
    else sdk_f16_to_f32(PTR(const uint16_t *, src), PTR(float *, dst), n, accumulate);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *qsgd_encode(PyObject *self, PyObject *args) {
    unsigned long long x, seed, norms, packed;
    long long n, bucket;
    int levels, bits, rc, max_norm = 0;
    if (!PyArg_ParseTuple(args, "KLLiiKKK|p", &x, &n, &bucket, &levels, &bits, &seed, &norms, &packed, &max_norm))
        return NULL;
    if (levels < 1 || levels > 127 || bits < 1 || bits > 8) {
        PyErr_SetString(PyExc_ValueError, "qsgd_encode: levels must be in 1..127 and bits in 1..8");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = sdk_qsgd_encode(PTR(const float *, x), n, bucket, levels, bits, seed, max_norm, PTR(float *, norms),
                         PTR(uint8_t *, packed));
    Py_END_ALLOW_THREADS
    if (rc) return no_memory("qsgd_encode");
    Py_RETURN_NONE;
}

static PyObject *qsgd_decode(PyObject *self, PyObject *args) {
    unsigned long long norms, packed, out;
    long long n, bucket;
    int levels, bits, acc;
    if (!PyArg_ParseTuple(args, "KKLLiiKp", &norms, &packed, &n, &bucket, &levels, &bits, &out, &acc))
        return NULL;
    if (levels < 1 || levels > 127 || bits < 1 || bits > 8) {
        PyErr_SetString(PyExc_ValueError, "qsgd_decode: levels must be in 1..127 and bits in 1..8");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    sdk_qsgd_decode(PTR(const float *, norms), PTR(const uint8_t *, packed), n, bucket, levels, bits,
                    PTR(float *, out), acc);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *topk(PyObject *self, PyObject *args) {
    unsigned long long x, idx, val;
    long long n, k;
    int rc;
    if (!PyArg_ParseTuple(args, "KLLKK", &x, &n, &k, &idx, &val)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = sdk_topk(PTR(const float *, x), n, k, PTR(int64_t *, idx), PTR(float *, val));
    Py_END_ALLOW_THREADS
    if (rc) return no_memory("topk");
    Py_RETURN_NONE;
}

static PyObject *lowrank_call(PyObject *args, int sub) {
    unsigned long long p, q, out;
    long long numel, rows, cols;
    int r, rc;
    const char *name = sub ? "lowrank_subtract" : "lowrank_product";
    if (!PyArg_ParseTuple(args, "KKLLLiK", &p, &q, &numel, &rows, &cols, &r, &out)) return NULL;
    if (r < 1 || rows < 1 || cols < 1 || numel > rows * cols) {
        PyErr_Format(PyExc_ValueError, "%s: needs r >= 1 and numel <= rows * cols", name);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = (sub ? sdk_lowrank_subtract : sdk_lowrank_product)(PTR(const float *, p), PTR(const float *, q), numel,
                                                            rows, cols, r, PTR(float *, out));
    Py_END_ALLOW_THREADS
    if (rc) return no_memory(name);
    Py_RETURN_NONE;
}

static PyObject *lowrank_product(PyObject *self, PyObject *args) { return lowrank_call(args, 0); }
static PyObject *lowrank_subtract(PyObject *self, PyObject *args) { return lowrank_call(args, 1); }

static PyObject *powersgd_project(PyObject *self, PyObject *args) {
    unsigned long long g, m, pe, qe, q, pt;
    long long numel, rows, cols;
    float scale;
    int mode, r, rc;
    if (!PyArg_ParseTuple(args, "KfKiKKKLLLiK", &g, &scale, &m, &mode, &pe, &qe, &q, &numel, &rows, &cols, &r, &pt))
        return NULL;
    if (r < 1 || rows < 1 || cols < 1 || numel > rows * cols || mode < 0 || mode > 2) {
        PyErr_SetString(PyExc_ValueError, "powersgd_project: needs r >= 1, numel <= rows * cols, mode 0, 1 or 2");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = sdk_powersgd_project(PTR(const float *, g), scale, PTR(float *, m), mode, PTR(const float *, pe),
                              PTR(const float *, qe), PTR(const float *, q), numel, rows, cols, r, PTR(float *, pt));
    Py_END_ALLOW_THREADS
    if (rc) return no_memory("powersgd_project");
    Py_RETURN_NONE;
}

static PyObject *powersgd_back(PyObject *self, PyObject *args) {
    unsigned long long p, m, qt;
    long long numel, rows, cols;
    int r;
    if (!PyArg_ParseTuple(args, "KKLLLiK", &p, &m, &numel, &rows, &cols, &r, &qt)) return NULL;
    if (r < 1 || rows < 1 || cols < 1 || numel > rows * cols) {
        PyErr_SetString(PyExc_ValueError, "powersgd_back: needs r >= 1 and numel <= rows * cols");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    sdk_powersgd_back(PTR(const float *, p), PTR(const float *, m), numel, rows, cols, r, PTR(float *, qt));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *feedback_before(PyObject *self, PyObject *args) {
    unsigned long long g, d, v, out;
    long long n;
    float c;
    if (!PyArg_ParseTuple(args, "KKKfKL", &g, &d, &v, &c, &out, &n)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    sdk_feedback_before(PTR(const float *, g), PTR(const float *, d), PTR(const float *, v), c, PTR(float *, out), n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *feedback_after(PyObject *self, PyObject *args) {
    unsigned long long r, v, d, v_out;
    long long n;
    float c;
    int finite;
    if (!PyArg_ParseTuple(args, "KKfKKL", &r, &v, &c, &d, &v_out, &n)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    finite = sdk_feedback_after(PTR(float *, r), PTR(const float *, v), c, PTR(const float *, d), PTR(float *, v_out), n);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(finite);
}

static PyObject *set_threads(PyObject *self, PyObject *args) {
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    sdk_set_threads(n);
    return PyLong_FromLong(sdk_get_threads());
}

static PyObject *force_scalar(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    sdk_force_scalar(on);
    Py_RETURN_NONE;
}

static PyObject *fail_allocations(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    sdk_fail_allocations(on);
    Py_RETURN_NONE;
}

static PyObject *features(PyObject *self, PyObject *noargs) { return PyUnicode_FromString(sdk_features()); }

static PyMethodDef methods[] = {
    {"onebit_encode", onebit_encode, METH_VARARGS,
     "(g, e_in, pending, e_out, defer, n, bucket, means, bits, div)"},
    {"onebit_decode", onebit_decode, METH_VARARGS, "(means, bits, n, bucket, out, accumulate)"},
    {"scaled_sign_encode", scaled_sign_encode, METH_VARARGS,
     "(g, e_in, pending, p_out, n, bucket, bits, scales, div)"},
    {"scaled_sign_decode", scaled_sign_decode, METH_VARARGS, "(scales, bits, n, bucket, out, accumulate)"},
    {"convert", convert, METH_VARARGS, "(src, dst, n, scale, bf16, to_half[, accumulate]): half -> float32 may add into dst"},
    {"qsgd_encode", qsgd_encode, METH_VARARGS, "(x, n, bucket, levels, bits, seed, norms, packed, max_norm=False)"},
    {"qsgd_decode", qsgd_decode, METH_VARARGS, "(norms, packed, n, bucket, levels, bits, out, accumulate)"},
    {"topk", topk, METH_VARARGS, "(x, n, k, idx, val)"},
    {"lowrank_product", lowrank_product, METH_VARARGS, "(p, q, numel, rows, cols, r, out): PowerSGD's P Q^T"},
    {"lowrank_subtract", lowrank_subtract, METH_VARARGS, "(p, q, numel, rows, cols, r, m): m -= P Q^T in place"},
    {"powersgd_project", powersgd_project, METH_VARARGS,
     "(g, scale, m, mode, pe, qe, q, numel, rows, cols, r, pt): M = [M - Pe Qe^T] + scale G; P^T = (M Q)^T"},
    {"powersgd_back", powersgd_back, METH_VARARGS, "(p, m, numel, rows, cols, r, qt): Qw^T = P^T M"},
    {"feedback_before", feedback_before, METH_VARARGS, "(g, d, v, c, out, n): out = g / d + c * v"},
    {"feedback_after", feedback_after, METH_VARARGS,
     "(r, v, c, d, v_out, n): v_out = r; r = (r - c * v) * d; True if r was finite"},
    {"set_threads", set_threads, METH_VARARGS, "threads for vectors of 1M+ elements; returns the value set"},
    {"force_scalar", force_scalar, METH_VARARGS, "True: skip the AVX2/F16C paths"},
    {"fail_allocations", fail_allocations, METH_VARARGS, "True: every allocation in the kernels fails (tests)"},
    {"features", features, METH_NOARGS, "the SIMD paths this CPU runs"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "spark_dl._native",
                                    "Gradient-compression kernels on raw memory (see native/kernels.h).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
