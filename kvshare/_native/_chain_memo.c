/* kvshare._chain.ChainMemo: the sha256 block chain with a bounded, verified memo of blocks.
 *
 *     memo = ChainMemo(block_tokens, capacity_blocks, tail)
 *     memo.chain(parent, ids) -> list[bytes]    # == sha256_chain_u32(parent, ids, block_tokens, tail)
 *     memo.chain_packed(parent, data) -> list[bytes]  # ids already packed: little-endian u32 bytes
 *
 * Each block's digest is sha256(parent || block's ids as u32 || tail), a function of exactly
 * the parent digest and the block's bytes. The memo keeps, for up to ``capacity_blocks`` recent
 * blocks, that input (the 32-byte parent and the block's packed ids) and its digest. A block is
 * answered from the memo only when both are byte-for-byte equal to a kept entry's (memcmp), so
 * a memoised answer is the digest sha256 gives for that very input: correctness never depends
 * on the 64-bit fingerprint that picks the entry's set (a fingerprint collision only costs a
 * comparison). Every id is read and range-checked on every call (hit or miss), with
 * ``pack_u32``'s refusals, so what the caller is told about bad ids does not depend on the memo.
 *
 * Table: ``sets`` x 4 ways (sets a power of two), least recently used way replaced. Memory:
 * capacity x (4 x block_tokens + ~120) bytes. The GIL is held throughout (the ids are Python
 * objects), so one memo may be shared by threads. ``fingerprint_bits`` < 64 weakens the
 * fingerprint on purpose (tests: 0 puts every block in one set, all decided by the comparison).
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED 1
#include <Python.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#include "_u32.h"

#define DIGEST 32
#define WAYS 4
#define MAX_TAIL 64

typedef struct {
    uint64_t key;      /* fingerprint of (parent, block bytes); 0 with digest NULL: empty */
    uint64_t used;     /* the call that last used it (LRU within the set) */
    unsigned char parent[DIGEST];
    PyObject *digest;  /* the block's hash (a 32-byte bytes object, shared with callers) */
} Entry;

typedef struct {
    PyObject_HEAD
    Py_ssize_t block_tokens;
    Py_ssize_t sets;   /* a power of two */
    uint64_t mask;     /* fingerprint bits kept */
    uint64_t clock;
    unsigned long long hits, misses;
    Py_ssize_t tail_len;
    unsigned char tail[MAX_TAIL];
    Entry *entries;    /* sets * WAYS */
    unsigned char *data; /* each entry's block bytes (4 * block_tokens) */
    unsigned char *buf;  /* the block being read */
} ChainMemo;

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* A fast 64-bit fingerprint of the parent and the block bytes (its quality only spreads sets). */
static uint64_t fingerprint(const unsigned char *parent, const unsigned char *data, size_t len)
{
    const uint64_t p1 = 0x9E3779B185EBCA87ULL, p2 = 0xC2B2AE3D27D4EB4FULL;
    uint64_t a, b = 0, c = 0, d = 0;
    memcpy(&a, parent, 8); /* a sha256 digest: already uniform */
    size_t i = 0;
    for (; i + 32 <= len; i += 32) {
        uint64_t w[4];
        memcpy(w, data + i, 32);
        a = rotl(a + w[0] * p2, 31) * p1;
        b = rotl(b + w[1] * p2, 31) * p1;
        c = rotl(c + w[2] * p2, 31) * p1;
        d = rotl(d + w[3] * p2, 31) * p1;
    }
    for (; i < len; i++)
        a = rotl(a ^ data[i], 5) * p1;
    uint64_t h = rotl(a, 1) + rotl(b, 7) + rotl(c, 12) + rotl(d, 18) + len;
    h ^= h >> 33;
    h *= p2;
    h ^= h >> 29;
    return h;
}

static void memo_dealloc(ChainMemo *self)
{
    if (self->entries != NULL) {
        for (Py_ssize_t i = 0; i < self->sets * WAYS; i++)
            Py_XDECREF(self->entries[i].digest);
    }
    PyMem_Free(self->entries);
    PyMem_Free(self->data);
    PyMem_Free(self->buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int memo_init(ChainMemo *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"block_tokens", "capacity_blocks", "tail", "fingerprint_bits", NULL};
    Py_ssize_t block_tokens, capacity;
    Py_buffer tail;
    int bits = 64;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nny*|i:ChainMemo", names, &block_tokens,
                                     &capacity, &tail, &bits))
        return -1;
    int rc = -1;
    if (self->entries != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ChainMemo is already initialised");
        goto done;
    }
    if (block_tokens <= 0 || capacity < WAYS || bits < 0 || bits > 64 || tail.len > MAX_TAIL) {
        PyErr_Format(PyExc_ValueError,
                     "ChainMemo needs block_tokens > 0, capacity_blocks >= %d, 0 <= "
                     "fingerprint_bits <= 64 and a tail of at most %d bytes", WAYS, MAX_TAIL);
        goto done;
    }
    Py_ssize_t sets = 1;
    while (sets * 2 * WAYS <= capacity)
        sets *= 2;
    self->block_tokens = block_tokens;
    self->sets = sets;
    self->mask = bits == 64 ? ~0ULL : ((1ULL << bits) - 1);
    self->tail_len = tail.len;
    memcpy(self->tail, tail.buf, (size_t)tail.len);
    self->entries = PyMem_Calloc((size_t)(sets * WAYS), sizeof(Entry));
    self->data = PyMem_Malloc((size_t)(sets * WAYS * block_tokens * 4));
    self->buf = PyMem_Malloc((size_t)block_tokens * 4);
    if (self->entries == NULL || self->data == NULL || self->buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    rc = 0;
done:
    PyBuffer_Release(&tail);
    return rc;
}

/* The digest of the block in self->buf after ``prev`` (a new reference): the memo's, or
 * computed and kept. NULL with an exception if out of memory. */
static PyObject *block_digest(ChainMemo *self, const unsigned char *prev)
{
    size_t bb = (size_t)self->block_tokens * 4;
    uint64_t key = fingerprint(prev, self->buf, bb) & self->mask;
    Py_ssize_t base = (Py_ssize_t)(key & (uint64_t)(self->sets - 1)) * WAYS;
    Entry *set = self->entries + base;
    Py_ssize_t victim = 0;
    self->clock++;
    for (Py_ssize_t w = 0; w < WAYS; w++) {
        Entry *e = set + w;
        if (e->digest == NULL) {
            victim = w;
            continue;
        }
        if (e->key == key && memcmp(e->parent, prev, DIGEST) == 0
                && memcmp(self->data + (base + w) * bb, self->buf, bb) == 0) {
            e->used = self->clock;
            self->hits++;
            Py_INCREF(e->digest);
            return e->digest;
        }
        if (set[victim].digest != NULL && e->used < set[victim].used)
            victim = w;
    }
    unsigned char out[DIGEST];
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, prev, DIGEST);
    SHA256_Update(&ctx, self->buf, bb);
    if (self->tail_len > 0)
        SHA256_Update(&ctx, self->tail, (size_t)self->tail_len);
    SHA256_Final(out, &ctx);
    PyObject *digest = PyBytes_FromStringAndSize((const char *)out, DIGEST);
    if (digest == NULL)
        return NULL;
    self->misses++;
    Entry *e = set + victim;
    Py_XSETREF(e->digest, Py_NewRef(digest));
    e->key = key;
    e->used = self->clock;
    memcpy(e->parent, prev, DIGEST);
    memcpy(self->data + (base + victim) * bb, self->buf, bb);
    return digest;
}

static PyObject *memo_chain(ChainMemo *self, PyObject *args)
{
    const char *parent;
    Py_ssize_t parent_len;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "y#O:chain", &parent, &parent_len, &seq))
        return NULL;
    if (self->entries == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ChainMemo was not initialised");
        return NULL;
    }
    if (parent_len != DIGEST)
        return PyErr_Format(PyExc_ValueError, "parent must be %d bytes (a sha256 digest), got %zd",
                            DIGEST, parent_len);
    PyObject *fast = PySequence_Fast(seq, "token ids must be a list or tuple of ints");
    if (fast == NULL)
        return NULL;
    Py_ssize_t bt = self->block_tokens, n = PySequence_Fast_GET_SIZE(fast), n_blocks = n / bt;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *result = PyList_New(n_blocks);
    if (result == NULL)
        goto fail;
    unsigned char prev[DIGEST];
    memcpy(prev, parent, DIGEST);
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        PyObject **ids = items + b * bt;
        for (Py_ssize_t j = 0; j < bt; j++) {
            prefetch_id(items, b * bt + j, n);
            if (read_u32(ids[j], self->buf + 4 * j) < 0)
                goto fail;
        }
        PyObject *digest = block_digest(self, prev);
        if (digest == NULL)
            goto fail;
        memcpy(prev, PyBytes_AS_STRING(digest), DIGEST);
        PyList_SET_ITEM(result, b, digest);
    }
    for (Py_ssize_t i = n_blocks * bt; i < n; i++) { /* the partial block: checked */
        if (read_u32(items[i], self->buf) < 0)
            goto fail;
    }
    Py_DECREF(fast);
    return result;
fail:
    Py_XDECREF(result);
    Py_DECREF(fast);
    return NULL;
}

/* chain_packed(parent, data): chain() of ids already packed as little-endian u32 (any
 * contiguous bytes-like object of 4 * n bytes: bytes, a numpy uint32 array or array("I") on a
 * little-endian host); no id to read or check, a packed id is in range by construction. */
static PyObject *memo_chain_packed(ChainMemo *self, PyObject *args)
{
    const char *parent;
    Py_ssize_t parent_len;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y#y*:chain_packed", &parent, &parent_len, &data))
        return NULL;
    PyObject *result = NULL;
    if (self->entries == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ChainMemo was not initialised");
        goto done;
    }
    if (parent_len != DIGEST) {
        PyErr_Format(PyExc_ValueError, "parent must be %d bytes (a sha256 digest), got %zd",
                     DIGEST, parent_len);
        goto done;
    }
    if (data.len % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "packed ids must be 4 bytes each (u32), got %zd bytes",
                     data.len);
        goto done;
    }
    size_t bb = (size_t)self->block_tokens * 4;
    Py_ssize_t n_blocks = data.len / (Py_ssize_t)bb;
    result = PyList_New(n_blocks);
    if (result == NULL)
        goto done;
    unsigned char prev[DIGEST];
    memcpy(prev, parent, DIGEST);
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        memcpy(self->buf, (const unsigned char *)data.buf + (size_t)b * bb, bb);
        PyObject *digest = block_digest(self, prev);
        if (digest == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        memcpy(prev, PyBytes_AS_STRING(digest), DIGEST);
        PyList_SET_ITEM(result, b, digest);
    }
done:
    PyBuffer_Release(&data);
    return result;
}

static PyObject *memo_clear(ChainMemo *self, PyObject *unused)
{
    (void)unused;
    for (Py_ssize_t i = 0; self->entries != NULL && i < self->sets * WAYS; i++) {
        Py_CLEAR(self->entries[i].digest);
        self->entries[i].key = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *memo_stats(ChainMemo *self, PyObject *unused)
{
    (void)unused;
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; self->entries != NULL && i < self->sets * WAYS; i++)
        kept += self->entries[i].digest != NULL;
    return Py_BuildValue("{sKsKsnsn}", "hits", self->hits, "misses", self->misses, "blocks", kept,
                         "capacity", self->sets * WAYS);
}

static PyMethodDef memo_methods[] = {
    {"chain", (PyCFunction)memo_chain, METH_VARARGS,
     "chain(parent, ids) -> list[bytes]\n\n"
     "sha256_chain_u32(parent, ids, block_tokens, tail), blocks seen before answered from "
     "the memo (after comparing their parent and bytes)."},
    {"chain_packed", (PyCFunction)memo_chain_packed, METH_VARARGS,
     "chain_packed(parent, data) -> list[bytes]\n\n"
     "chain() of ids already packed as little-endian u32 bytes (4 * n bytes, any contiguous "
     "bytes-like object)."},
    {"clear", (PyCFunction)memo_clear, METH_NOARGS, "Forget every kept block."},
    {"stats", (PyCFunction)memo_stats, METH_NOARGS,
     "{'hits', 'misses', 'blocks' (kept now), 'capacity'}"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ChainMemoType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvshare._native._chain.ChainMemo",
    .tp_basicsize = sizeof(ChainMemo),
    .tp_dealloc = (destructor)memo_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ChainMemo(block_tokens, capacity_blocks, tail, fingerprint_bits=64): the sha256 "
              "block chain with a verified memo of recent blocks (see _chain_memo.c).",
    .tp_methods = memo_methods,
    .tp_init = (initproc)memo_init,
    .tp_new = PyType_GenericNew,
};

/* Adds ChainMemo to the module (called by PyInit__chain); -1 with an exception on failure. */
int chain_memo_add_type(PyObject *module)
{
    if (PyType_Ready(&ChainMemoType) < 0)
        return -1;
    Py_INCREF(&ChainMemoType);
    if (PyModule_AddObject(module, "ChainMemo", (PyObject *)&ChainMemoType) < 0) {
        Py_DECREF(&ChainMemoType);
        return -1;
    }
    return 0;
}
