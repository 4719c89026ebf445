/* kvshare._chain.xxh3_bind / xxh3_chain: the xxh3-128 block chain (the opt-in, non-cryptographic
 * hash of single-tenant clusters) in C.
 *
 *     xxh3_bind(path) -> bool
 *         Find ``XXH3_128bits`` in the already loaded shared library at ``path`` (the ``xxhash``
 *         package's extension: the very function kvshare.hashing's Python loop calls) and use it
 *         from now on. False (nothing bound) where the library is not loaded or lacks it.
 *     xxh3_chain(parent, data, block_bytes, tail) -> list[bytes]
 *         h_i = XXH3_128(h_{i-1} || data block i || tail), seed 0, as 16 canonical (big-endian)
 *         bytes (what ``xxhash.xxh3_128(...).digest()`` gives), h_{-1} = parent (16 bytes), for
 *         every full block of ``data`` (any C-contiguous buffer: the ids as little-endian u32).
 *
 * One-shot XXH3 over the concatenation equals the streaming hash the Python loop runs; the
 * tests compare the two. The GIL is held (a 32-block prompt takes about 2 us).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#define XDIGEST 16
#define XMAX_TAIL 64

typedef struct {
    uint64_t low64;
    uint64_t high64;
} xxh128_t; /* XXH128_hash_t's layout (xxhash.h, stable ABI since 0.8.0) */

typedef xxh128_t (*xxh3_128_fn)(const void *, size_t);
static xxh3_128_fn xxh3_128 = NULL;

static PyObject *xxh3_bind(PyObject *self, PyObject *args)
{
    (void)self;
    const char *path;
    if (!PyArg_ParseTuple(args, "s:xxh3_bind", &path))
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        Py_RETURN_FALSE;
    xxh3_128_fn fn = (xxh3_128_fn)dlsym(lib, "XXH3_128bits");
    /* the library stays loaded: the xxhash module that loaded it is never unloaded */
    dlclose(lib);
    if (fn == NULL)
        Py_RETURN_FALSE;
    xxh3_128 = fn;
    Py_RETURN_TRUE;
}

static void put_be64(unsigned char *dst, uint64_t v)
{
    for (int i = 7; i >= 0; i--) {
        dst[i] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
}

static PyObject *xxh3_chain(PyObject *self, PyObject *args)
{
    (void)self;
    const char *parent;
    Py_ssize_t parent_len, block_bytes;
    Py_buffer data, tail;
    if (!PyArg_ParseTuple(args, "y#y*ny*:xxh3_chain", &parent, &parent_len, &data, &block_bytes,
                          &tail))
        return NULL;
    PyObject *result = NULL;
    unsigned char *buf = NULL;
    if (xxh3_128 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvshare._native._chain: call xxh3_bind() first");
        goto done;
    }
    if (parent_len != XDIGEST || block_bytes <= 0 || tail.len > XMAX_TAIL) {
        PyErr_Format(PyExc_ValueError, "xxh3_chain needs a %d-byte parent, block_bytes > 0 and "
                     "a tail of at most %d bytes", XDIGEST, XMAX_TAIL);
        goto done;
    }
    Py_ssize_t n_blocks = data.len / block_bytes;
    size_t msg = XDIGEST + (size_t)block_bytes + (size_t)tail.len;
    buf = PyMem_Malloc(msg);
    result = PyList_New(n_blocks);
    if (buf == NULL || result == NULL) {
        if (buf == NULL)
            PyErr_NoMemory();
        Py_CLEAR(result);
        goto done;
    }
    memcpy(buf, parent, XDIGEST);
    memcpy(buf + XDIGEST + block_bytes, tail.buf, (size_t)tail.len);
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        memcpy(buf + XDIGEST, (const unsigned char *)data.buf + (size_t)b * (size_t)block_bytes,
               (size_t)block_bytes);
        xxh128_t h = xxh3_128(buf, msg);
        put_be64(buf, h.high64); /* canonical: high half first, big-endian */
        put_be64(buf + 8, h.low64);
        PyObject *digest = PyBytes_FromStringAndSize((const char *)buf, XDIGEST);
        if (digest == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, b, digest);
    }
done:
    PyMem_Free(buf);
    PyBuffer_Release(&data);
    PyBuffer_Release(&tail);
    return result;
}

static PyMethodDef xxh3_methods[] = {
    {"xxh3_bind", xxh3_bind, METH_VARARGS,
     "xxh3_bind(path) -> bool: use XXH3_128bits from the loaded library at path."},
    {"xxh3_chain", xxh3_chain, METH_VARARGS,
     "xxh3_chain(parent, data, block_bytes, tail) -> list[bytes]: the xxh3-128 block chain "
     "(canonical digests), h_{-1} = parent (16 bytes)."},
    {NULL, NULL, 0, NULL},
};

/* Adds xxh3_bind and xxh3_chain to the module (called by PyInit__chain); -1 on failure. */
int chain_xxh3_add(PyObject *module) { return PyModule_AddFunctions(module, xxh3_methods); }
