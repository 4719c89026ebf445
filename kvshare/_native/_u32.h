/* kvshare/_u32.h: reading Python token ids as little-endian u32 (shared by _chain.c and
 * _chain_memo.c, both parts of the kvshare._chain extension). */
#ifndef KVSHARE_U32_H
#define KVSHARE_U32_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* A non-negative int that fits one internal digit, read without a call; 0 if it does not. */
static inline int small_nonneg(PyObject *v, unsigned long *x)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)v))
        return 0;
    Py_ssize_t value = PyUnstable_Long_CompactValue((PyLongObject *)v);
    if (value < 0)
        return 0;
    *x = (unsigned long)value;
    return 1;
#else
    Py_ssize_t size = Py_SIZE(v);
    if (size == 0) {
        *x = 0;
        return 1;
    }
    if (size != 1)
        return 0;
    *x = (unsigned long)((PyLongObject *)v)->ob_digit[0];
    return 1;
#endif
}

/* Ids this far ahead are prefetched while one is read: a prompt's int objects are fresh, out
 * of cache, and reading each one's header is most of packing it (a hint: results are the same). */
#define U32_PREFETCH_AHEAD 16

/* Prefetch id ``i`` + U32_PREFETCH_AHEAD of ``items`` (``n`` of them) for reading. */
static inline void prefetch_id(PyObject *const *items, Py_ssize_t i, Py_ssize_t n)
{
#if defined(__GNUC__) || defined(__clang__)
    if (i + U32_PREFETCH_AHEAD < n)
        __builtin_prefetch(items[i + U32_PREFETCH_AHEAD], 0, 3);
#else
    (void)items; (void)i; (void)n;
#endif
}

/* One token id as u32: 0 on success; -1 with OverflowError for an id outside [0, 2**32) or
 * TypeError for a non-integer. */
static inline int read_u32(PyObject *v, unsigned char *dst)
{
    unsigned long x;
    if (PyLong_CheckExact(v) && small_nonneg(v, &x)) {
        /* one machine word: read in place (the common case, ~2x faster) */
    } else if (PyLong_Check(v)) {
        x = PyLong_AsUnsignedLong(v);
    } else {
        PyObject *idx = PyNumber_Index(v);
        if (idx == NULL)
            return -1;
        x = PyLong_AsUnsignedLong(idx);
        Py_DECREF(idx);
    }
    if (x == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (x > 0xFFFFFFFFUL) {
        PyErr_Format(PyExc_OverflowError, "token id %lu does not fit in u32", x);
        return -1;
    }
    dst[0] = (unsigned char)x;
    dst[1] = (unsigned char)(x >> 8);
    dst[2] = (unsigned char)(x >> 16);
    dst[3] = (unsigned char)(x >> 24);
    return 0;
}

#endif
