/* kvshare._statemap: a hash table from fixed-width keys (16 or 32 bytes) to small int states.
 *
 * The block index maps each block hash to an interned "holder state" (an int > 0; 0 means
 * absent and is never stored). This is that map in C: open addressing with linear probing,
 * keys stored inline next to their state (one cache line per probe), load factor <= 1/2,
 * backward-shift deletion (no tombstones). Lookups of a query's hashes are independent, so the
 * loop prefetches the slot of a hash a few positions ahead.
 *
 *   StateMap(key_size)
 *   len(m), m.get(key) -> int
 *   m.states(keys) -> list[int]                 per key (0 = absent)
 *   m.prefix_runs(keys) -> list[(state, n)]     runs of equal states up to the first absent key
 *   m.update(keys, fn) -> int                   state := fn(old) per key (0 deletes); fn is
 *                                               called once per distinct old state; returns
 *                                               how many keys changed
 *   m.transform_all(fn, collect=False)          the same over every stored key: how many
 *                                               changed, with collect (n, their keys packed)
 *   m.state_counts() -> dict[int, int]          keys per state
 *   m.items() -> list[(bytes, int)]
 *
 * ``keys`` is a list of bytes objects of exactly key_size bytes, or one bytes-like buffer of
 * concatenated keys. Anything else raises ValueError before anything changes. Not thread-safe
 * beyond the GIL: callers own the map from one thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t w[4];
    int64_t state; /* 0 = empty slot */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    Py_ssize_t mask; /* capacity - 1 (capacity a power of two) */
    Py_ssize_t used;
    int key_size;
} StateMap;

#define PREFETCH 6
#define CACHE 16

static inline uint64_t key_hash(const uint64_t *w)
{
    uint64_t h = (w[0] ^ ((w[1] << 29) | (w[1] >> 35))) * 0x9E3779B97F4A7C15ULL;
    return h ^ (h >> 31);
}

static inline void load_key(uint64_t *w, const char *p, int key_size)
{
    w[2] = w[3] = 0;
    memcpy(w, p, (size_t)key_size);
}

static inline Py_ssize_t find_slot(const StateMap *m, const uint64_t *w)
{
    Py_ssize_t i = (Py_ssize_t)(key_hash(w) & (uint64_t)m->mask);
    for (;;) {
        const Slot *s = &m->slots[i];
        if (s->state == 0 || (s->w[0] == w[0] && s->w[1] == w[1] && s->w[2] == w[2] &&
                              s->w[3] == w[3]))
            return i;
        i = (i + 1) & m->mask;
    }
}

static int resize(StateMap *m, Py_ssize_t capacity)
{
    Slot *old = m->slots;
    Py_ssize_t old_cap = m->mask + 1;
    Slot *fresh = PyMem_Calloc((size_t)capacity, sizeof(Slot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->slots = fresh;
    m->mask = capacity - 1;
    for (Py_ssize_t i = 0; old != NULL && i < old_cap; i++) {
        if (old[i].state != 0)
            m->slots[find_slot(m, old[i].w)] = old[i];
    }
    PyMem_Free(old);
    return 0;
}

static void delete_at(StateMap *m, Py_ssize_t i)
{
    /* backward-shift deletion: move later members of the probe run into the hole */
    Py_ssize_t j = i;
    for (;;) {
        j = (j + 1) & m->mask;
        if (m->slots[j].state == 0)
            break;
        Py_ssize_t home = (Py_ssize_t)(key_hash(m->slots[j].w) & (uint64_t)m->mask);
        /* slot j may move to i if its home is not in the cyclic range (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i].state = 0;
    m->used--;
}

/* ------------------------------------------------------------------ key sequences */

typedef struct {
    PyObject *list; /* a list of bytes, or NULL with buf set */
    Py_buffer buf;
    int has_buf;
    Py_ssize_t n;
} Keys;

static int keys_open(StateMap *m, PyObject *obj, Keys *k)
{
    k->list = NULL;
    k->has_buf = 0;
    if (PyList_Check(obj)) {
        Py_ssize_t n = PyList_GET_SIZE(obj);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(obj, i);
            if (!PyBytes_CheckExact(item) || PyBytes_GET_SIZE(item) != m->key_size) {
                PyErr_Format(PyExc_ValueError,
                             "block hashes must be %d-byte bytes; item %zd is %s of length %zd",
                             m->key_size, i, Py_TYPE(item)->tp_name,
                             PyBytes_Check(item) ? PyBytes_GET_SIZE(item) : (Py_ssize_t)-1);
                return -1;
            }
        }
        k->list = obj;
        k->n = n;
        return 0;
    }
    if (PyObject_GetBuffer(obj, &k->buf, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError,
                     "block hashes must be a list of bytes or one bytes buffer, not %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    k->has_buf = 1;
    if (k->buf.len % m->key_size) {
        PyErr_Format(PyExc_ValueError, "a buffer of %d-byte block hashes cannot be %zd bytes long",
                     m->key_size, k->buf.len);
        PyBuffer_Release(&k->buf);
        k->has_buf = 0;
        return -1;
    }
    k->n = k->buf.len / m->key_size;
    return 0;
}

static inline const char *key_at(const StateMap *m, const Keys *k, Py_ssize_t i)
{
    if (k->list != NULL)
        return PyBytes_AS_STRING(PyList_GET_ITEM(k->list, i));
    return (const char *)k->buf.buf + i * m->key_size;
}

static void keys_close(Keys *k)
{
    if (k->has_buf)
        PyBuffer_Release(&k->buf);
}

static inline void prefetch(const StateMap *m, const Keys *k, Py_ssize_t i)
{
    if (i < k->n) {
        uint64_t w[4];
        load_key(w, key_at(m, k, i), m->key_size);
        __builtin_prefetch(&m->slots[key_hash(w) & (uint64_t)m->mask]);
    }
}

/* ------------------------------------------------------------------ transitions */

typedef struct {
    int64_t from[CACHE], to[CACHE];
    int n;
    PyObject *fn;
} Trans;

static int trans_get(Trans *t, int64_t from, int64_t *to)
{
    for (int i = 0; i < t->n; i++) {
        if (t->from[i] == from) {
            *to = t->to[i];
            return 0;
        }
    }
    PyObject *r = PyObject_CallFunction(t->fn, "L", (long long)from);
    if (r == NULL)
        return -1;
    long long v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0) {
        PyErr_SetString(PyExc_ValueError, "a state must be an int >= 0");
        return -1;
    }
    if (t->n < CACHE) {
        t->from[t->n] = from;
        t->to[t->n++] = v;
    }
    *to = v;
    return 0;
}

/* ------------------------------------------------------------------ methods */

static int sm_init(StateMap *m, PyObject *args, PyObject *kwds)
{
    int key_size;
    static char *kwlist[] = {"key_size", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i:StateMap", kwlist, &key_size))
        return -1;
    if (key_size < 8 || key_size > 32) {
        PyErr_Format(PyExc_ValueError, "key_size must be 8..32 bytes, got %d", key_size);
        return -1;
    }
    m->key_size = key_size;
    m->used = 0;
    PyMem_Free(m->slots);
    m->slots = NULL;
    m->mask = 0;
    return resize(m, 64);
}

static void sm_dealloc(StateMap *m)
{
    PyMem_Free(m->slots);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t sm_len(StateMap *m) { return m->used; }

static PyObject *sm_get(StateMap *m, PyObject *key)
{
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != m->key_size)
        return PyLong_FromLong(0);
    uint64_t w[4];
    load_key(w, PyBytes_AS_STRING(key), m->key_size);
    return PyLong_FromLongLong(m->slots[find_slot(m, w)].state);
}

static PyObject *sm_states(StateMap *m, PyObject *obj)
{
    Keys k;
    if (keys_open(m, obj, &k) < 0)
        return NULL;
    PyObject *out = PyList_New(k.n);
    for (Py_ssize_t i = 0; out != NULL && i < k.n; i++) {
        prefetch(m, &k, i + PREFETCH);
        uint64_t w[4];
        load_key(w, key_at(m, &k, i), m->key_size);
        PyObject *v = PyLong_FromLongLong(m->slots[find_slot(m, w)].state);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    keys_close(&k);
    return out;
}

static PyObject *sm_prefix_runs(StateMap *m, PyObject *obj)
{
    Keys k;
    if (keys_open(m, obj, &k) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    int64_t cur = 0;
    Py_ssize_t run = 0;
    for (Py_ssize_t i = 0; out != NULL && i <= k.n; i++) {
        int64_t s = 0;
        if (i < k.n) {
            prefetch(m, &k, i + PREFETCH);
            uint64_t w[4];
            load_key(w, key_at(m, &k, i), m->key_size);
            s = m->slots[find_slot(m, w)].state;
        }
        if (s == cur && s != 0) {
            run++;
            continue;
        }
        if (cur != 0) {
            PyObject *t = Py_BuildValue("(Ln)", (long long)cur, run);
            if (t == NULL || PyList_Append(out, t) < 0)
                Py_CLEAR(out);
            Py_XDECREF(t);
        }
        if (s == 0)
            break;
        cur = s;
        run = 1;
    }
    keys_close(&k);
    return out;
}

static int set_state(StateMap *m, const uint64_t *w, Py_ssize_t i, int64_t to)
{
    if (to == 0) {
        delete_at(m, i);
        return 0;
    }
    Slot *s = &m->slots[i];
    if (s->state == 0) {
        memcpy(s->w, w, sizeof(s->w));
        s->state = to;
        if (++m->used * 2 > m->mask + 1)
            return resize(m, (m->mask + 1) * 2);
        return 0;
    }
    s->state = to;
    return 0;
}

static PyObject *sm_update(StateMap *m, PyObject *args)
{
    PyObject *obj, *fn;
    if (!PyArg_ParseTuple(args, "OO:update", &obj, &fn))
        return NULL;
    Keys k;
    if (keys_open(m, obj, &k) < 0)
        return NULL;
    Trans t = {.n = 0, .fn = fn};
    Py_ssize_t changed = 0;
    for (Py_ssize_t i = 0; i < k.n; i++) {
        prefetch(m, &k, i + PREFETCH);
        uint64_t w[4];
        load_key(w, key_at(m, &k, i), m->key_size);
        Py_ssize_t at = find_slot(m, w);
        int64_t old = m->slots[at].state, to;
        if (trans_get(&t, old, &to) < 0 || (to != old && set_state(m, w, at, to) < 0)) {
            keys_close(&k);
            return NULL;
        }
        changed += to != old;
    }
    keys_close(&k);
    return PyLong_FromSsize_t(changed);
}

static PyObject *sm_transform_all(StateMap *m, PyObject *args)
{
    PyObject *fn;
    int collect = 0;
    if (!PyArg_ParseTuple(args, "O|p:transform_all", &fn, &collect))
        return NULL;
    Trans t = {.n = 0, .fn = fn};
    Py_ssize_t changed = 0, dropped = 0, cap = m->mask + 1;
    PyObject *keys = collect ? PyByteArray_FromStringAndSize(NULL, 0) : NULL;
    if (collect && keys == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < cap; i++) {
        Slot *s = &m->slots[i];
        if (s->state == 0)
            continue;
        int64_t to;
        if (trans_get(&t, s->state, &to) < 0) {
            Py_XDECREF(keys); /* entries changed so far stay changed: fn must not fail */
            return NULL;
        }
        if (to != s->state) {
            if (keys != NULL) {
                Py_ssize_t at = PyByteArray_GET_SIZE(keys);
                if (PyByteArray_Resize(keys, at + m->key_size) < 0) {
                    Py_DECREF(keys);
                    return NULL;
                }
                memcpy(PyByteArray_AS_STRING(keys) + at, s->w, (size_t)m->key_size);
            }
            changed++;
            dropped += to == 0;
            s->state = to == 0 ? -1 : to; /* -1: removed when rebuilt below (deleting during
                                            the scan would move unvisited entries back) */
        }
    }
    if (dropped) {
        Slot *old = m->slots;
        Py_ssize_t live = m->used - dropped, fresh_cap = 64;
        while (fresh_cap < live * 2 + 2)
            fresh_cap *= 2;
        Slot *fresh = PyMem_Calloc((size_t)fresh_cap, sizeof(Slot));
        if (fresh == NULL) {
            Py_XDECREF(keys);
            return PyErr_NoMemory();
        }
        m->slots = fresh;
        m->mask = fresh_cap - 1;
        m->used = live;
        for (Py_ssize_t i = 0; i < cap; i++) {
            if (old[i].state > 0)
                m->slots[find_slot(m, old[i].w)] = old[i];
        }
        PyMem_Free(old);
    }
    if (keys == NULL)
        return PyLong_FromSsize_t(changed);
    PyObject *blob = PyBytes_FromStringAndSize(PyByteArray_AS_STRING(keys),
                                               PyByteArray_GET_SIZE(keys));
    Py_DECREF(keys);
    if (blob == NULL)
        return NULL;
    return Py_BuildValue("(nN)", changed, blob);
}

static PyObject *sm_state_counts(StateMap *m, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyDict_New();
    for (Py_ssize_t i = 0; out != NULL && i <= m->mask; i++) {
        if (m->slots[i].state == 0)
            continue;
        PyObject *key = PyLong_FromLongLong(m->slots[i].state);
        PyObject *prev = key ? PyDict_GetItemWithError(out, key) : NULL;
        PyObject *val = (key && !PyErr_Occurred())
                            ? PyLong_FromSsize_t((prev ? PyLong_AsSsize_t(prev) : 0) + 1) : NULL;
        if (val == NULL || PyDict_SetItem(out, key, val) < 0)
            Py_CLEAR(out);
        Py_XDECREF(key);
        Py_XDECREF(val);
    }
    return out;
}

static PyObject *sm_items(StateMap *m, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i <= m->mask; i++) {
        Slot *s = &m->slots[i];
        if (s->state == 0)
            continue;
        PyObject *t = Py_BuildValue("(y#L)", (const char *)s->w, (Py_ssize_t)m->key_size,
                                    (long long)s->state);
        if (t == NULL || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    return out;
}

static PyMethodDef sm_methods[] = {
    {"get", (PyCFunction)sm_get, METH_O, "get(key) -> state (0 if absent)"},
    {"states", (PyCFunction)sm_states, METH_O, "states(keys) -> list of states"},
    {"prefix_runs", (PyCFunction)sm_prefix_runs, METH_O,
     "prefix_runs(keys) -> [(state, n)] up to the first absent key"},
    {"update", (PyCFunction)sm_update, METH_VARARGS, "update(keys, fn) -> keys changed"},
    {"transform_all", (PyCFunction)sm_transform_all, METH_VARARGS,
     "transform_all(fn, collect=False) -> keys changed (and their bytes when collect)"},
    {"state_counts", (PyCFunction)sm_state_counts, METH_NOARGS, "{state: keys}"},
    {"items", (PyCFunction)sm_items, METH_NOARGS, "[(key, state)]"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods sm_as_sequence = {.sq_length = (lenfunc)sm_len};

static PyTypeObject StateMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvshare._native._statemap.StateMap",
    .tp_basicsize = sizeof(StateMap),
    .tp_dealloc = (destructor)sm_dealloc,
    .tp_as_sequence = &sm_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "fixed-width key -> int state map (see the module docstring)",
    .tp_methods = sm_methods,
    .tp_init = (initproc)sm_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef statemap_module = {
    PyModuleDef_HEAD_INIT, "_statemap", "Fixed-width key -> int state hash table.", -1, NULL,
};

PyMODINIT_FUNC PyInit__statemap(void)
{
    if (PyType_Ready(&StateMapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&statemap_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&StateMapType);
    if (PyModule_AddObject(m, "StateMap", (PyObject *)&StateMapType) < 0) {
        Py_DECREF(&StateMapType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
