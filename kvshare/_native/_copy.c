/* kvshare._copy: block copies with non-temporal stores (optional accelerator).
 *
 * stream_copy(dst, src) -> None
 *
 *     Copy the bytes of ``src`` into ``dst`` (two C-contiguous buffers of the same length, ``dst``
 *     writable) with streaming stores that bypass the cache, then ``sfence`` so the bytes are
 *     visible to other cores (and processes mapping the same memory) before the call returns.
 *
 * Why: glibc's memcpy streams only above ``x86_non_temporal_threshold`` (hundreds of MiB on big
 * L3 caches), so a 2 MiB block copy goes through the cache: every destination line is first
 * read for ownership, then written back, one extra memory pass per copy. A pool block is
 * written once and read later by someone else, the case streaming stores are made for.
 *
 * copy_chunks(dst, dst_offsets, src, src_offsets, chunk) -> None
 *
 *     For each i: copy ``chunk`` bytes from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]``
 *     (offsets: int64 buffers of the same length; every range is checked to lie inside its
 *     buffer before anything is copied: ValueError, nothing copied). Plain (cached) memcpy, GIL
 *     released: one call moves a batch of blocks between canonical order and an engine's pages
 *     (e.g. vLLM-CPU's, 4 KiB per page, head and k|v) without a Python-level loop.
 *
 * x86-64 only (SSE2 is part of the base ISA; AVX2 used when the CPU has it); elsewhere the module
 * still builds, ``NON_TEMPORAL`` is 0 and ``stream_copy`` is a plain memcpy. Overlapping buffers
 * are copied with memmove. The GIL is released for copies of 64 KiB or more.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define GIL_MINSIZE (64 * 1024)
#define PREFETCH 2048 /* bytes ahead: software prefetch carries on across 4 KiB page boundaries,
                       * where hardware prefetchers stop (measured ~5-10% on 2 MiB blocks) */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_NT 1

/* Copy the unaligned head with memcpy so every streaming store is aligned to the vector size. */
static size_t align_head(char *d, const char *s, size_t n, size_t vec)
{
    size_t head = (vec - ((uintptr_t)d & (vec - 1))) & (vec - 1);
    if (head > n)
        head = n;
    memcpy(d, s, head);
    return head;
}

/* One streaming loop per vector width W (bytes): four W-byte vectors a step, each 64-byte line
 * of the source prefetched PREFETCH bytes ahead, then sfence and the tail with memcpy. */
#define STREAM_LOOP(ATTR, NAME, VEC, W, LOAD, STORE)                                              \
    ATTR static void NAME(char *d, const char *s, size_t n)                                       \
    {                                                                                             \
        size_t i = align_head(d, s, n, W);                                                        \
        for (; i + 4 * W <= n; i += 4 * W) {                                                      \
            for (size_t line = 0; line < 4 * W; line += 64)                                       \
                _mm_prefetch(s + i + PREFETCH + line, _MM_HINT_T0);                               \
            VEC a = LOAD((const VEC *)(s + i));                                                   \
            VEC b = LOAD((const VEC *)(s + i + W));                                               \
            VEC c = LOAD((const VEC *)(s + i + 2 * W));                                           \
            VEC e = LOAD((const VEC *)(s + i + 3 * W));                                           \
            STORE((VEC *)(d + i), a);                                                             \
            STORE((VEC *)(d + i + W), b);                                                         \
            STORE((VEC *)(d + i + 2 * W), c);                                                     \
            STORE((VEC *)(d + i + 3 * W), e);                                                     \
        }                                                                                         \
        _mm_sfence();                                                                             \
        memcpy(d + i, s + i, n - i);                                                              \
    }

STREAM_LOOP(__attribute__((target("avx2"))), copy_avx2, __m256i, 32, _mm256_loadu_si256,
            _mm256_stream_si256)
STREAM_LOOP(, copy_sse2, __m128i, 16, _mm_loadu_si128, _mm_stream_si128)

static int use_avx2 = -1;

static void stream(char *d, const char *s, size_t n)
{
    if (use_avx2)
        copy_avx2(d, s, n);
    else
        copy_sse2(d, s, n);
}
#else
#define HAVE_NT 0
static void stream(char *d, const char *s, size_t n) { memcpy(d, s, n); }
#endif

static void copy_bytes(char *d, const char *s, size_t n)
{
    if (d < s + n && s < d + n)
        memmove(d, s, n); /* overlapping: the streaming loop copies forward only */
    else
        stream(d, s, n);
}

static PyObject *stream_copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*:stream_copy", &dst, &src))
        return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError,
                     "stream_copy needs buffers of the same length, got dst %zd and src %zd bytes",
                     dst.len, src.len);
        goto done;
    }
    if (dst.len >= GIL_MINSIZE) {
        Py_BEGIN_ALLOW_THREADS
        copy_bytes(dst.buf, src.buf, (size_t)dst.len);
        Py_END_ALLOW_THREADS
    } else {
        copy_bytes(dst.buf, src.buf, (size_t)dst.len);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *copy_chunks(PyObject *self, PyObject *args)
{
    Py_buffer dst, doff, src, soff;
    Py_ssize_t chunk;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*y*n:copy_chunks", &dst, &doff, &src, &soff, &chunk))
        return NULL;
    PyObject *result = NULL;
    const int64_t *d_off = (const int64_t *)doff.buf, *s_off = (const int64_t *)soff.buf;
    Py_ssize_t n = doff.len / (Py_ssize_t)sizeof(int64_t);
    if (doff.len != soff.len || doff.len % (Py_ssize_t)sizeof(int64_t) || chunk < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_chunks needs two int64 offset buffers of the same length and chunk >= 0");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (d_off[i] < 0 || d_off[i] > dst.len - chunk || s_off[i] < 0 || s_off[i] > src.len - chunk) {
            PyErr_Format(PyExc_ValueError,
                         "copy_chunks: chunk %zd (dst offset %lld, src offset %lld, %zd bytes) lies "
                         "outside dst (%zd bytes) or src (%zd bytes)", i, (long long)d_off[i],
                         (long long)s_off[i], chunk, dst.len, src.len);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        memmove((char *)dst.buf + d_off[i], (const char *)src.buf + s_off[i], (size_t)chunk);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&doff);
    PyBuffer_Release(&src);
    PyBuffer_Release(&soff);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_chunks", copy_chunks, METH_VARARGS,
     "copy_chunks(dst, dst_offsets, src, src_offsets, chunk): gather/scatter equal-size chunks."},
    {"stream_copy", stream_copy, METH_VARARGS,
     "stream_copy(dst, src): copy src into dst (same length) with non-temporal stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvshare._native._copy",
    "Block copies with non-temporal stores (see _copy.c).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copy(void)
{
#if HAVE_NT
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "NON_TEMPORAL", HAVE_NT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
