/* kvshare._chain: the sha256 block-hash chain loop in C (optional accelerator).
 *
 * sha256_chain(parent, data, block_bytes, tail) -> list[bytes]
 * pack_u32(ids) -> bytes (a list of token ids as little-endian u32, range-checked)
 * sha256_chain_u32(parent, ids, block_tokens, tail) -> list[bytes] (both in one pass)
 * ChainMemo(block_tokens, capacity_blocks, tail).chain(parent, ids): sha256_chain_u32 with a
 *     verified memo of recent blocks (_chain_memo.c)
 *
 *     h_{-1} = parent
 *     h_i    = SHA256(h_{i-1} || data[i*block_bytes:(i+1)*block_bytes] || tail)
 *
 * for every full block of ``data`` (a trailing partial block is not hashed). This is exactly the
 * loop of kvshare.hashing.block_hashes for sha256 without extra keys (tail = field(b"")); the
 * Python loop stays the reference and the fallback when this module is not built.
 *
 * ``data`` is any C-contiguous buffer (bytes, memoryview, a contiguous numpy array: its raw
 * bytes are hashed). The GIL is released while hashing inputs of 2048 bytes or more, like
 * hashlib does. Uses OpenSSL's low-level SHA256_* calls: per block they cost nothing beyond the
 * compression function, whereas EVP_DigestInit/Final add a few hundred nanoseconds of dispatch
 * per 1 KiB block (measured). They are deprecated in OpenSSL 3.0 but present in every 3.x.
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED 1
#include <Python.h>
#include <openssl/sha.h>
#include <string.h>

#include "_u32.h"

#define DIGEST 32
#define GIL_MINSIZE 2048

static void chain_loop(const unsigned char *parent, const unsigned char *data, Py_ssize_t n_blocks,
                       Py_ssize_t block_bytes, const unsigned char *tail, Py_ssize_t tail_len,
                       unsigned char *out)
{
    SHA256_CTX ctx;
    const unsigned char *prev = parent;
    for (Py_ssize_t i = 0; i < n_blocks; i++) {
        unsigned char *dst = out + i * DIGEST;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, prev, DIGEST);
        SHA256_Update(&ctx, data + i * block_bytes, (size_t)block_bytes);
        if (tail_len > 0)
            SHA256_Update(&ctx, tail, (size_t)tail_len);
        SHA256_Final(dst, &ctx);
        prev = dst;
    }
}

/* ValueError (-1) unless the parent is one sha256 digest and ``size`` (named ``size_name``) > 0. */
static int check_chain_args(Py_ssize_t parent_len, const char *size_name, Py_ssize_t size)
{
    if (parent_len != DIGEST) {
        PyErr_Format(PyExc_ValueError, "parent must be %d bytes (a sha256 digest), got %zd",
                     DIGEST, parent_len);
        return -1;
    }
    if (size <= 0) {
        PyErr_Format(PyExc_ValueError, "%s must be positive, got %zd", size_name, size);
        return -1;
    }
    return 0;
}

static PyObject *sha256_chain(PyObject *self, PyObject *args)
{
    const char *parent;
    Py_ssize_t parent_len, block_bytes;
    Py_buffer data, tail;
    (void)self;
    if (!PyArg_ParseTuple(args, "y#y*ny*:sha256_chain", &parent, &parent_len, &data, &block_bytes,
                          &tail))
        return NULL;
    PyObject *result = NULL;
    unsigned char *out = NULL;
    if (check_chain_args(parent_len, "block_bytes", block_bytes) < 0)
        goto done;
    Py_ssize_t n_blocks = data.len / block_bytes;
    result = PyList_New(n_blocks);
    if (result == NULL || n_blocks == 0)
        goto done;
    out = PyMem_Malloc((size_t)n_blocks * DIGEST);
    if (out == NULL) {
        Py_CLEAR(result);
        PyErr_NoMemory();
        goto done;
    }
    unsigned char first[DIGEST]; /* parent's bytes may not be touched without the GIL */
    memcpy(first, parent, DIGEST);
    if (n_blocks * block_bytes >= GIL_MINSIZE) {
        Py_BEGIN_ALLOW_THREADS
        chain_loop(first, data.buf, n_blocks, block_bytes, tail.buf, tail.len, out);
        Py_END_ALLOW_THREADS
    } else {
        chain_loop(first, data.buf, n_blocks, block_bytes, tail.buf, tail.len, out);
    }
    for (Py_ssize_t i = 0; i < n_blocks; i++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)out + i * DIGEST, DIGEST);
        if (digest == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, digest);
    }
done:
    PyMem_Free(out);
    PyBuffer_Release(&data);
    PyBuffer_Release(&tail);
    return result;
}

/* pack_u32(ids) -> bytes: a list or tuple of ints (anything with __index__) as little-endian
 * u32, range-checked; OverflowError for an id outside [0, 2**32), TypeError for a non-integer.
 * One pass straight into the bytes object (array.array("I").fromlist + tobytes is two). */
static PyObject *pack_u32(PyObject *self, PyObject *seq)
{
    (void)self;
    PyObject *fast = PySequence_Fast(seq, "token ids must be a list or tuple of ints");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (read_u32(items[i], dst + 4 * i) < 0) {
            Py_DECREF(fast);
            Py_DECREF(out);
            return NULL;
        }
    }
    Py_DECREF(fast);
    return out;
}

/* sha256_chain_u32(parent, ids, block_tokens, tail) -> list[bytes]: sha256_chain(parent,
 * pack_u32(ids), 4 * block_tokens, tail) in one pass: each block's ids are packed into a small
 * buffer and hashed while it is in cache, no packed copy of the prompt is made. Every id is
 * checked (those of a trailing partial block too), with pack_u32's refusals. The GIL stays
 * held (the ids are Python objects), so callers keep this to prompts of moderate length. */
static PyObject *sha256_chain_u32(PyObject *self, PyObject *args)
{
    const char *parent;
    Py_ssize_t parent_len, block_tokens;
    PyObject *seq;
    Py_buffer tail;
    (void)self;
    if (!PyArg_ParseTuple(args, "y#Ony*:sha256_chain_u32", &parent, &parent_len, &seq,
                          &block_tokens, &tail))
        return NULL;
    PyObject *result = NULL, *fast = NULL;
    unsigned char *buf = NULL;
    if (check_chain_args(parent_len, "block_tokens", block_tokens) < 0)
        goto done;
    fast = PySequence_Fast(seq, "token ids must be a list or tuple of ints");
    if (fast == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), n_blocks = n / block_tokens;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    buf = PyMem_Malloc((size_t)block_tokens * 4);
    result = PyList_New(n_blocks);
    if (buf == NULL || result == NULL) {
        Py_CLEAR(result);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    unsigned char prev[DIGEST];
    memcpy(prev, parent, DIGEST);
    SHA256_CTX ctx;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        PyObject **ids = items + b * block_tokens;
        for (Py_ssize_t j = 0; j < block_tokens; j++) {
            prefetch_id(items, b * block_tokens + j, n);
            if (read_u32(ids[j], buf + 4 * j) < 0) {
                Py_CLEAR(result);
                goto done;
            }
        }
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, prev, DIGEST);
        SHA256_Update(&ctx, buf, (size_t)block_tokens * 4);
        if (tail.len > 0)
            SHA256_Update(&ctx, tail.buf, (size_t)tail.len);
        SHA256_Final(prev, &ctx);
        PyObject *digest = PyBytes_FromStringAndSize((const char *)prev, DIGEST);
        if (digest == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, b, digest);
    }
    for (Py_ssize_t i = n_blocks * block_tokens; i < n; i++) { /* the partial block: checked */
        if (read_u32(items[i], buf) < 0) {
            Py_CLEAR(result);
            goto done;
        }
    }
done:
    PyMem_Free(buf);
    Py_XDECREF(fast);
    PyBuffer_Release(&tail);
    return result;
}

static PyMethodDef methods[] = {
    {"pack_u32", pack_u32, METH_O,
     "pack_u32(ids) -> bytes\n\n"
     "A list or tuple of ints as little-endian u32 bytes (OverflowError outside [0, 2**32))."},
    {"sha256_chain_u32", sha256_chain_u32, METH_VARARGS,
     "sha256_chain_u32(parent, ids, block_tokens, tail) -> list[bytes]\n\n"
     "sha256_chain(parent, pack_u32(ids), 4 * block_tokens, tail) in one pass, GIL held."},
    {"sha256_chain", sha256_chain, METH_VARARGS,
     "sha256_chain(parent, data, block_bytes, tail) -> list[bytes]\n\n"
     "h_i = sha256(h_{i-1} || data block i || tail) for every full block of data, "
     "h_{-1} = parent (32 bytes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvshare._native._chain",
    "The sha256 block-hash chain loop in C (see kvshare.hashing).", -1, methods,
    NULL, NULL, NULL, NULL,
};

int chain_memo_add_type(PyObject *module); /* _chain_memo.c */
int chain_xxh3_add(PyObject *module);      /* _chain_xxh3.c */

PyMODINIT_FUNC PyInit__chain(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (chain_memo_add_type(m) < 0 || chain_xxh3_add(m) < 0))
        Py_CLEAR(m);
    return m;
}
