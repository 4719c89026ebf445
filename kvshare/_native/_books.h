/* _books.h: the ordered hash table under the router's C books (kvshare._pending, kvshare._ready).
 *
 * Keys are (namespace id, block hash bytes of 1..32); every entry sits on one list in the order
 * the book keeps (insertion, or refresh: moved to the end), across all namespaces, so "the
 * oldest entry" is the list's head. Lookups hash the key's bytes; open addressing with linear
 * probing over a power-of-two slot array at most half full, deletions shift the probe chain back
 * (no tombstones). Entries live in one growing array, reused through a free list; an entry's
 * index never changes while it lives. The payload fields mean what each book says.
 *
 * Header-only (static functions): each book is its own extension module.
 */
#ifndef KVSHARE_BOOKS_H
#define KVSHARE_BOOKS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BK_KEY_MAX 32
#define BK_NONE (-1)

typedef struct {
    uint64_t h;       /* hash of (ns, key) */
    int32_t prev, next; /* the book's order (next doubles as the free list's link) */
    uint32_t ns;
    uint8_t klen;
    uint8_t key[BK_KEY_MAX];
    /* payload */
    double t;         /* pending: the earliest holder expiry; ready: when it is stored */
    uint64_t call;    /* the number of the add call that last set it */
    void *p;          /* pending: its holder set */
    int32_t a;        /* ready: the worker id */
    int32_t b;        /* ready: whether others can pull it */
} BkEntry;

typedef struct {
    BkEntry *e;
    int32_t ecap, used, free_head;
    int32_t *slots; /* entry index + 1; 0 = empty */
    uint64_t mask;
    int32_t head, tail;
    Py_ssize_t size;
    Py_ssize_t *ns_size; /* live entries per namespace id */
    Py_ssize_t ns_cap;
} BkTable;

static inline uint64_t bk_hash(uint32_t ns, const uint8_t *key, Py_ssize_t n)
{
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ ((uint64_t)ns * 0xC2B2AE3D27D4EB4FULL) ^ (uint64_t)n;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, key + i, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 32;
    }
    for (; i < n; i++) {
        h = (h ^ key[i]) * 0x100000001B3ULL;
    }
    h ^= h >> 29;
    h *= 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 32);
}

static inline int bk_init(BkTable *t)
{
    memset(t, 0, sizeof(*t));
    t->mask = 63;
    t->slots = (int32_t *)calloc(64, sizeof(int32_t));
    t->head = t->tail = t->free_head = BK_NONE;
    return t->slots ? 0 : -1;
}

static inline void bk_free(BkTable *t)
{
    free(t->e);
    free(t->slots);
    free(t->ns_size);
    memset(t, 0, sizeof(*t));
}

static inline int bk_ns_reserve(BkTable *t, uint32_t ns)
{
    if ((Py_ssize_t)ns < t->ns_cap)
        return 0;
    Py_ssize_t cap = t->ns_cap ? t->ns_cap * 2 : 8;
    while (cap <= (Py_ssize_t)ns)
        cap *= 2;
    Py_ssize_t *n = (Py_ssize_t *)realloc(t->ns_size, (size_t)cap * sizeof(Py_ssize_t));
    if (!n)
        return -1;
    memset(n + t->ns_cap, 0, (size_t)(cap - t->ns_cap) * sizeof(Py_ssize_t));
    t->ns_size = n;
    t->ns_cap = cap;
    return 0;
}

static inline Py_ssize_t bk_ns_size(const BkTable *t, uint32_t ns)
{
    return (Py_ssize_t)ns < t->ns_cap ? t->ns_size[ns] : 0;
}

/* The entry of (ns, key), or BK_NONE. */
static inline int32_t bk_find(const BkTable *t, uint32_t ns, const uint8_t *key, Py_ssize_t n)
{
    uint64_t h = bk_hash(ns, key, n);
    for (uint64_t s = h & t->mask;; s = (s + 1) & t->mask) {
        int32_t v = t->slots[s];
        if (v == 0)
            return BK_NONE;
        const BkEntry *e = &t->e[v - 1];
        if (e->h == h && e->ns == ns && e->klen == n && memcmp(e->key, key, (size_t)n) == 0)
            return v - 1;
    }
}

/* A hint: start loading the slots, then the entries, that finding the bytes keys ``items[0 ..
 * n)`` will read (a big book's lookups are cache misses; issued together they overlap). Keys
 * that are not bytes of at most BK_KEY_MAX are skipped (the lookup itself reports them). */
static inline void bk_prefetch(const BkTable *t, uint32_t ns, PyObject *const *items, Py_ssize_t n)
{
    uint64_t hs[64];
    for (Py_ssize_t k0 = 0; k0 < n; k0 += 64) {
        Py_ssize_t m = n - k0 < 64 ? n - k0 : 64;
        for (Py_ssize_t k = 0; k < m; k++) {
            PyObject *o = items[k0 + k];
            hs[k] = 0;
            if (PyBytes_Check(o) && PyBytes_GET_SIZE(o) <= BK_KEY_MAX) {
                hs[k] = bk_hash(ns, (const uint8_t *)PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o));
                __builtin_prefetch(&t->slots[hs[k] & t->mask]);
            }
        }
        for (Py_ssize_t k = 0; k < m; k++) {
            int32_t v = t->slots[hs[k] & t->mask];
            if (v)
                __builtin_prefetch(&t->e[v - 1]);
        }
    }
}

static inline int bk_grow_slots(BkTable *t)
{
    uint64_t cap = (t->mask + 1) * 2;
    int32_t *slots = (int32_t *)calloc(cap, sizeof(int32_t));
    if (!slots)
        return -1;
    for (uint64_t s = 0; s <= t->mask; s++) {
        int32_t v = t->slots[s];
        if (v) {
            uint64_t d = t->e[v - 1].h & (cap - 1);
            while (slots[d])
                d = (d + 1) & (cap - 1);
            slots[d] = v;
        }
    }
    free(t->slots);
    t->slots = slots;
    t->mask = cap - 1;
    return 0;
}

static inline void bk_unlink(BkTable *t, int32_t i)
{
    BkEntry *e = &t->e[i];
    if (e->prev != BK_NONE)
        t->e[e->prev].next = e->next;
    else
        t->head = e->next;
    if (e->next != BK_NONE)
        t->e[e->next].prev = e->prev;
    else
        t->tail = e->prev;
}

static inline void bk_append(BkTable *t, int32_t i)
{
    BkEntry *e = &t->e[i];
    e->prev = t->tail;
    e->next = BK_NONE;
    if (t->tail != BK_NONE)
        t->e[t->tail].next = i;
    else
        t->head = i;
    t->tail = i;
}

/* Move entry i to the end of the order (a refresh). */
static inline void bk_to_end(BkTable *t, int32_t i)
{
    if (t->tail == i)
        return;
    bk_unlink(t, i);
    bk_append(t, i);
}

/* A new entry (ns, key) at the end of the order, payload zeroed; its index or -1 (MemoryError
 * set). The key must not be present. */
static inline int32_t bk_insert(BkTable *t, uint32_t ns, const uint8_t *key, Py_ssize_t n)
{
    if (bk_ns_reserve(t, ns) < 0)
        goto nomem;
    if ((uint64_t)(t->size + 1) * 2 > t->mask + 1 && bk_grow_slots(t) < 0)
        goto nomem;
    int32_t i;
    if (t->free_head != BK_NONE) {
        i = t->free_head;
        t->free_head = t->e[i].next;
    } else {
        if (t->used == t->ecap) {
            if (t->ecap >= INT32_MAX / 2)
                goto nomem;
            int32_t cap = t->ecap ? t->ecap * 2 : 64;
            BkEntry *e = (BkEntry *)realloc(t->e, (size_t)cap * sizeof(BkEntry));
            if (!e)
                goto nomem;
            t->e = e;
            t->ecap = cap;
        }
        i = t->used++;
    }
    BkEntry *e = &t->e[i];
    memset(e, 0, sizeof(*e));
    e->h = bk_hash(ns, key, n);
    e->ns = ns;
    e->klen = (uint8_t)n;
    memcpy(e->key, key, (size_t)n);
    uint64_t s = e->h & t->mask;
    while (t->slots[s])
        s = (s + 1) & t->mask;
    t->slots[s] = i + 1;
    bk_append(t, i);
    t->size++;
    t->ns_size[ns]++;
    return i;
nomem:
    PyErr_NoMemory();
    return -1;
}

/* Remove entry i (its payload must be released by the caller first). */
static inline void bk_remove(BkTable *t, int32_t i)
{
    BkEntry *e = &t->e[i];
    uint64_t s = e->h & t->mask;
    while (t->slots[s] != i + 1)
        s = (s + 1) & t->mask;
    /* backward-shift deletion: pull later members of the probe chain into the hole */
    uint64_t hole = s;
    for (uint64_t j = (hole + 1) & t->mask; t->slots[j]; j = (j + 1) & t->mask) {
        uint64_t home = t->e[t->slots[j] - 1].h & t->mask;
        /* move j's entry into the hole unless its home lies cyclically in (hole, j] */
        int in_between = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!in_between) {
            t->slots[hole] = t->slots[j];
            hole = j;
        }
    }
    t->slots[hole] = 0;
    bk_unlink(t, i);
    t->size--;
    t->ns_size[e->ns]--;
    e->next = t->free_head;
    t->free_head = i;
}

/* A block hash argument as (pointer, length); -1 with TypeError/ValueError otherwise. */
static inline int bk_key(PyObject *o, const uint8_t **key, Py_ssize_t *n)
{
    if (!PyBytes_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "block hashes must be bytes");
        return -1;
    }
    *n = PyBytes_GET_SIZE(o);
    if (*n > BK_KEY_MAX) {
        PyErr_SetString(PyExc_ValueError, "block hashes of at most 32 bytes");
        return -1;
    }
    *key = (const uint8_t *)PyBytes_AS_STRING(o);
    return 0;
}

/* The id of ``name`` in ``ids`` (a dict name -> int), added as ``len(ids)`` when ``add``;
 * -1 when absent and not added, -2 on error. */
static inline Py_ssize_t bk_intern(PyObject *ids, PyObject *names, PyObject *name, int add)
{
    PyObject *v = PyDict_GetItemWithError(ids, name);
    if (v)
        return PyLong_AsSsize_t(v);
    if (PyErr_Occurred())
        return -2;
    if (!add)
        return -1;
    Py_ssize_t id = PyList_GET_SIZE(names);
    PyObject *idobj = PyLong_FromSsize_t(id);
    if (!idobj)
        return -2;
    int bad = PyDict_SetItem(ids, name, idobj) < 0 || PyList_Append(names, name) < 0;
    Py_DECREF(idobj);
    return bad ? -2 : id;
}

#endif
