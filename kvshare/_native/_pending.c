/* kvshare._pending.Book: router.pending.PendingBlocks in C (the same holders, order and answers).
 *
 *     Book(ttl_s, max_entries, clock, runs_type, tiers)     # tiers[code]: the Tier of a code
 *     book.add(namespace, location, hashes, tier=tiers[0]) # location will hold them, ttl_s
 *     book.match_runs(namespace, hashes) -> runs_type(len(hashes), [(((loc, code), ...), n), ...])
 *     book.forget(location)                                # it holds none of them after all
 *     len(book)
 *
 * Per (namespace, hash): its pending holders, an immutable set of (location, tier code, expiry)
 * shared between the blocks that got it together (as the Python book shares its holder maps),
 * the number of the add call that last refreshed it and the earliest expiry of its holders as
 * the Python book records it. Expiry, refresh order, eviction past max_entries and the runs
 * answered are the Python book's step for step (router/pending.py is the reference; the
 * tests run both on random sequences). ``clock()`` is called when the Python book calls it;
 * ``book._clock`` may be replaced, as the Python book's may.
 */
#include "_books.h"
#include <structmember.h>

typedef struct {
    int32_t loc;
    int32_t tier;
    double exp;
} Holder;

typedef struct {
    Py_ssize_t refs;
    int32_t n;
    Holder h[];
} HSet;

typedef struct {
    PyObject_HEAD
    BkTable t;
    double ttl;
    Py_ssize_t max;
    uint64_t calls;
    PyObject *clock, *runs_type;
    PyObject *ns_ids, *ns_names, *loc_ids, *loc_names;
    PyObject *codes; /* tier code -> int object */
    PyObject *tiers; /* tier code -> Tier object */
} Book;

static HSet *hset_new(int32_t n)
{
    HSet *s = (HSet *)malloc(sizeof(HSet) + (size_t)n * sizeof(Holder));
    if (!s) {
        PyErr_NoMemory();
        return NULL;
    }
    s->refs = 0;
    s->n = n;
    return s;
}

static inline void hset_release(HSet *s)
{
    if (s && --s->refs <= 0)
        free(s);
}

/* The Python book's ``a == b`` of two holder maps (order-insensitive, values compared). */
static int hset_equal(const HSet *a, const HSet *b)
{
    if (a->n != b->n)
        return 0;
    for (int32_t i = 0; i < a->n; i++) {
        int found = 0;
        for (int32_t j = 0; j < b->n; j++) {
            if (b->h[j].loc == a->h[i].loc) {
                if (b->h[j].tier != a->h[i].tier || !(b->h[j].exp == a->h[i].exp))
                    return 0;
                found = 1;
                break;
            }
        }
        if (!found)
            return 0;
    }
    return 1;
}

static int now_of(Book *self, double *now)
{
    PyObject *v = PyObject_CallNoArgs(self->clock);
    if (!v)
        return -1;
    *now = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*now == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* PendingBlocks._expire: drop the entries whose holders all expired from the front, up to the
 * first one still (partly) live, which keeps only its live holders. */
static int expire(Book *self, double now)
{
    BkTable *t = &self->t;
    while (t->head != BK_NONE) {
        int32_t i = t->head;
        BkEntry *e = &t->e[i];
        if (now < e->t)
            break;
        HSet *s = (HSet *)e->p;
        int32_t live = 0;
        for (int32_t j = 0; j < s->n; j++)
            live += s->h[j].exp > now;
        if (live) {
            HSet *keep = hset_new(live);
            if (!keep)
                return -1;
            double first = 0.0;
            int32_t m = 0;
            for (int32_t j = 0; j < s->n; j++) {
                if (s->h[j].exp > now) {
                    keep->h[m] = s->h[j];
                    if (m == 0 || keep->h[m].exp < first)
                        first = keep->h[m].exp;
                    m++;
                }
            }
            keep->refs = 1;
            hset_release(s);
            e->p = keep;
            e->t = first;
            break;
        }
        hset_release(s);
        bk_remove(t, i);
    }
    return 0;
}

static void drop_oldest(Book *self)
{
    BkTable *t = &self->t;
    int32_t i = t->head;
    hset_release((HSet *)t->e[i].p);
    bk_remove(t, i);
}

typedef struct {
    HSet *old, *new;
    double first;
} Grown;

/* The position of location ``loc`` among ``s``'s holders, or -1. */
static int32_t hset_find(const HSet *s, int32_t loc)
{
    for (int32_t j = 0; j < s->n; j++) {
        if (s->h[j].loc == loc)
            return j;
    }
    return -1;
}

/* The set ``old`` was already turned into during this call, or NULL. */
static Grown *grown_find(Grown *grown, Py_ssize_t n, const HSet *old)
{
    for (Py_ssize_t j = 0; j < n; j++) {
        if (grown[j].old == old)
            return &grown[j];
    }
    return NULL;
}

/* Record that ``old`` becomes ``s`` (earliest expiry ``first``) for the rest of this call:
 * ``old`` is kept alive (so its address stays unique) and ``s`` held until the caller releases
 * both. NULL with MemoryError (``s`` released) when the list cannot grow. */
static Grown *grown_push(Grown **grown, Py_ssize_t *n, Py_ssize_t *cap, HSet *old, HSet *s,
                         double first)
{
    s->refs = 1;
    if (*n == *cap) {
        Py_ssize_t want = *cap ? *cap * 2 : 4;
        Grown *gr = (Grown *)realloc(*grown, (size_t)want * sizeof(Grown));
        if (!gr) {
            hset_release(s);
            PyErr_NoMemory();
            return NULL;
        }
        *grown = gr;
        *cap = want;
    }
    old->refs++;
    Grown *g = &(*grown)[(*n)++];
    g->old = old;
    g->new = s;
    g->first = first;
    return g;
}

/* Release what :func:`grown_push` held, and the list. */
static void grown_free(Grown *grown, Py_ssize_t n)
{
    for (Py_ssize_t j = 0; j < n; j++) {
        hset_release(grown[j].old);
        hset_release(grown[j].new);
    }
    free(grown);
}

static PyObject *book_add(Book *self, PyObject *args)
{
    PyObject *ns_obj, *loc_obj, *hashes_obj, *tier_obj = PyTuple_GET_ITEM(self->tiers, 0);
    if (!PyArg_ParseTuple(args, "UUO|O:add", &ns_obj, &loc_obj, &hashes_obj, &tier_obj))
        return NULL;
    int tier = -1;
    for (Py_ssize_t c = 0; c < PyTuple_GET_SIZE(self->tiers); c++) {
        if (PyTuple_GET_ITEM(self->tiers, c) == tier_obj)
            tier = (int)c;
    }
    if (tier < 0) {
        PyErr_SetString(PyExc_ValueError, "add needs one of the tiers the book was made with");
        return NULL;
    }
    PyObject *hashes = PySequence_Fast(hashes_obj, "hashes must be a sequence of bytes");
    if (!hashes)
        return NULL;
    double now;
    Grown *grown = NULL;
    Py_ssize_t n_grown = 0, cap_grown = 0;
    HSet *fresh = NULL;
    PyObject *out = NULL;
    if (now_of(self, &now) < 0 || expire(self, now) < 0)
        goto done;
    double exp = now + self->ttl;
    Py_ssize_t ns = bk_intern(self->ns_ids, self->ns_names, ns_obj, 1);
    Py_ssize_t loc = bk_intern(self->loc_ids, self->loc_names, loc_obj, 1);
    if (ns < 0 || loc < 0)
        goto done;
    self->calls++;
    uint64_t call = self->calls;
    fresh = hset_new(1);
    if (!fresh)
        goto done;
    fresh->refs = 1; /* this call's own reference, released at the end */
    fresh->h[0] = (Holder){(int32_t)loc, tier, exp};
    BkTable *t = &self->t;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    bk_prefetch(t, (uint32_t)ns, items, n);
    for (Py_ssize_t k = 0; k < n; k++) {
        const uint8_t *key;
        Py_ssize_t klen;
        if (bk_key(items[k], &key, &klen) < 0)
            goto done;
        int32_t i = bk_find(t, (uint32_t)ns, key, klen);
        if (i == BK_NONE) {
            i = bk_insert(t, (uint32_t)ns, key, klen);
            if (i < 0)
                goto done;
            BkEntry *e = &t->e[i];
            e->p = fresh;
            fresh->refs++;
            e->t = exp;
            e->call = call;
            continue;
        }
        bk_to_end(t, i);
        BkEntry *e = &t->e[i];
        HSet *old = (HSet *)e->p;
        Grown *g = grown_find(grown, n_grown, old);
        if (!g) {
            int32_t at = hset_find(old, (int32_t)loc);
            HSet *s = hset_new(old->n + (at < 0));
            if (!s)
                goto done;
            memcpy(s->h, old->h, (size_t)old->n * sizeof(Holder));
            s->h[at < 0 ? old->n : at] = (Holder){(int32_t)loc, tier, exp};
            g = grown_push(&grown, &n_grown, &cap_grown, old, s, e->t < exp ? e->t : exp);
            if (!g)
                goto done;
        }
        g->new->refs++;
        e->p = g->new;
        e->t = g->first;
        e->call = call;
        hset_release(old);
    }
    while (t->size > self->max)
        drop_oldest(self);
    out = Py_NewRef(Py_None);
done:
    grown_free(grown, n_grown);
    hset_release(fresh);
    Py_DECREF(hashes);
    return out;
}

/* PendingBlocks.forget: drop ``location`` from every entry's holders; an entry left with none
 * goes. The others, their expiries and the order stay; an entry's earliest expiry is its
 * remaining holders' earliest. Entries that shared a holder set share the smaller one. */
static PyObject *book_forget(Book *self, PyObject *args)
{
    PyObject *loc_obj;
    if (!PyArg_ParseTuple(args, "U:forget", &loc_obj))
        return NULL;
    Py_ssize_t loc = bk_intern(self->loc_ids, self->loc_names, loc_obj, 0);
    if (loc == -2)
        return NULL;
    if (loc < 0) /* never held anything here */
        Py_RETURN_NONE;
    BkTable *t = &self->t;
    Grown *done = NULL;
    Py_ssize_t n_done = 0, cap_done = 0;
    PyObject *out = NULL;
    for (int32_t i = t->head; i != BK_NONE;) {
        BkEntry *e = &t->e[i];
        int32_t next = e->next;
        HSet *old = (HSet *)e->p;
        int32_t at = hset_find(old, (int32_t)loc);
        if (at >= 0 && old->n == 1) {
            hset_release(old);
            bk_remove(t, i);
        } else if (at >= 0) {
            Grown *g = grown_find(done, n_done, old);
            if (!g) {
                HSet *s = hset_new(old->n - 1);
                if (!s)
                    goto end;
                double first = 0.0;
                for (int32_t j = 0, m = 0; j < old->n; j++) {
                    if (j == at)
                        continue;
                    s->h[m] = old->h[j];
                    if (m == 0 || s->h[m].exp < first)
                        first = s->h[m].exp;
                    m++;
                }
                g = grown_push(&done, &n_done, &cap_done, old, s, first);
                if (!g)
                    goto end;
            }
            g->new->refs++;
            e->p = g->new;
            e->t = g->first;
            hset_release(old);
        }
        i = next;
    }
    out = Py_NewRef(Py_None);
end:
    grown_free(done, n_done);
    return out;
}

typedef struct {
    Py_ssize_t start, end, off, n; /* live holders: buf[off .. off + n) */
} Run;

static PyObject *runs_answer(Book *self, Py_ssize_t num, Run *runs, Py_ssize_t n_runs,
                             const Holder *buf)
{
    PyObject *list = PyList_New(n_runs);
    if (!list)
        return NULL;
    for (Py_ssize_t r = 0; r < n_runs; r++) {
        PyObject *holders = PyTuple_New(runs[r].n);
        if (!holders)
            goto fail;
        for (Py_ssize_t j = 0; j < runs[r].n; j++) {
            const Holder *h = &buf[runs[r].off + j];
            PyObject *pair = PyTuple_Pack(2, PyList_GET_ITEM(self->loc_names, h->loc),
                                          PyTuple_GET_ITEM(self->codes, h->tier));
            if (!pair) {
                Py_DECREF(holders);
                goto fail;
            }
            PyTuple_SET_ITEM(holders, j, pair);
        }
        PyObject *run = Py_BuildValue("(Nn)", holders, runs[r].end - runs[r].start);
        if (!run)
            goto fail;
        PyList_SET_ITEM(list, r, run);
    }
    return PyObject_CallFunction(self->runs_type, "nN", num, list);
fail:
    Py_DECREF(list);
    return NULL;
}

static PyObject *book_match_runs(Book *self, PyObject *args)
{
    PyObject *ns_obj, *hashes_obj;
    if (!PyArg_ParseTuple(args, "UO:match_runs", &ns_obj, &hashes_obj))
        return NULL;
    PyObject *hashes = PySequence_Fast(hashes_obj, "hashes must be a sequence of bytes");
    if (!hashes)
        return NULL;
    Py_ssize_t num = PySequence_Fast_GET_SIZE(hashes);
    Run *runs = NULL;
    Holder *buf = NULL;
    Py_ssize_t n_runs = 0, cap_runs = 0, used = 0, cap_buf = 0;
    PyObject *out = NULL;
    Py_ssize_t ns = -1;
    if (self->t.size) {
        double now;
        if (now_of(self, &now) < 0 || expire(self, now) < 0)
            goto done;
        ns = bk_intern(self->ns_ids, self->ns_names, ns_obj, 0);
        if (ns == -2)
            goto done;
        if (ns >= 0 && bk_ns_size(&self->t, (uint32_t)ns)) {
            BkTable *t = &self->t;
            PyObject **items = PySequence_Fast_ITEMS(hashes);
            bk_prefetch(t, (uint32_t)ns, items, num);
            HSet *prev = NULL;
            for (Py_ssize_t k = 0; k < num; k++) {
                const uint8_t *key;
                Py_ssize_t klen;
                if (bk_key(items[k], &key, &klen) < 0)
                    goto done;
                int32_t i = bk_find(t, (uint32_t)ns, key, klen);
                if (i == BK_NONE)
                    break;
                HSet *s = (HSet *)t->e[i].p;
                if (s != prev && (prev == NULL || !hset_equal(s, prev))) {
                    if (used + s->n > cap_buf) {
                        cap_buf = (used + s->n) * 2 + 16;
                        Holder *b = (Holder *)realloc(buf, (size_t)cap_buf * sizeof(Holder));
                        if (!b) {
                            PyErr_NoMemory();
                            goto done;
                        }
                        buf = b;
                    }
                    Py_ssize_t m = 0;
                    for (int32_t j = 0; j < s->n; j++) {
                        if (s->h[j].exp > now)
                            buf[used + m++] = s->h[j];
                    }
                    if (!m)
                        break;
                    prev = s;
                    Run *last = n_runs ? &runs[n_runs - 1] : NULL;
                    int same = last && last->n == m;
                    for (Py_ssize_t j = 0; same && j < m; j++) {
                        const Holder *x = &buf[last->off + j], *y = &buf[used + j];
                        same = x->loc == y->loc && x->tier == y->tier;
                    }
                    if (same) {
                        last->end = k + 1;
                    } else {
                        if (n_runs == cap_runs) {
                            cap_runs = cap_runs ? cap_runs * 2 : 8;
                            Run *r = (Run *)realloc(runs, (size_t)cap_runs * sizeof(Run));
                            if (!r) {
                                PyErr_NoMemory();
                                goto done;
                            }
                            runs = r;
                        }
                        runs[n_runs++] = (Run){k, k + 1, used, m};
                        used += m;
                    }
                } else {
                    runs[n_runs - 1].end = k + 1;
                }
            }
        }
    }
    out = runs_answer(self, num, runs, n_runs, buf);
done:
    free(runs);
    free(buf);
    Py_DECREF(hashes);
    return out;
}

static Py_ssize_t book_len(Book *self) { return self->t.size; }

static int book_init(Book *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"ttl_s", "max_entries", "clock", "runs_type", "tiers", NULL};
    double ttl;
    Py_ssize_t max;
    PyObject *clock, *runs_type, *tiers;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "dnOOO!:Book", kw, &ttl, &max, &clock,
                                     &runs_type, &PyTuple_Type, &tiers))
        return -1;
    if (!(ttl > 0) || max < 0) {
        PyErr_SetString(PyExc_ValueError, "ttl_s must be positive and max_entries >= 0");
        return -1;
    }
    if (self->ns_ids) {
        PyErr_SetString(PyExc_RuntimeError, "Book is initialised once");
        return -1;
    }
    self->ttl = ttl;
    self->max = max;
    self->clock = Py_NewRef(clock);
    self->runs_type = Py_NewRef(runs_type);
    self->ns_ids = PyDict_New();
    self->ns_names = PyList_New(0);
    self->loc_ids = PyDict_New();
    self->loc_names = PyList_New(0);
    self->tiers = Py_NewRef(tiers);
    self->codes = PyTuple_New(PyTuple_GET_SIZE(tiers));
    for (Py_ssize_t c = 0; self->codes && c < PyTuple_GET_SIZE(tiers); c++) {
        PyObject *code = PyLong_FromSsize_t(c);
        if (!code)
            return -1;
        PyTuple_SET_ITEM(self->codes, c, code);
    }
    if (!self->ns_ids || !self->ns_names || !self->loc_ids || !self->loc_names || !self->codes)
        return -1;
    if (bk_init(&self->t) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void book_dealloc(Book *self)
{
    if (self->t.e) {
        for (int32_t i = self->t.head; i != BK_NONE; i = self->t.e[i].next)
            hset_release((HSet *)self->t.e[i].p);
    }
    bk_free(&self->t);
    Py_XDECREF(self->clock);
    Py_XDECREF(self->runs_type);
    Py_XDECREF(self->ns_ids);
    Py_XDECREF(self->ns_names);
    Py_XDECREF(self->loc_ids);
    Py_XDECREF(self->loc_names);
    Py_XDECREF(self->codes);
    Py_XDECREF(self->tiers);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef book_methods[] = {
    {"add", (PyCFunction)book_add, METH_VARARGS,
     "add(namespace, location, hashes, tier=tiers[0]): location will hold hashes for ttl_s."},
    {"forget", (PyCFunction)book_forget, METH_VARARGS,
     "forget(location): location will hold none of its pending blocks (its cache was emptied)."},
    {"match_runs", (PyCFunction)book_match_runs, METH_VARARGS,
     "match_runs(namespace, hashes) -> runs_type(len(hashes), runs): live pending holders."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef book_members[] = {
    {"ttl_s", T_DOUBLE, offsetof(Book, ttl), READONLY, "seconds a pending block is kept"},
    {"_clock", T_OBJECT_EX, offsetof(Book, clock), 0, "the clock (as PendingBlocks._clock)"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods book_as_seq = {.sq_length = (lenfunc)book_len};

static PyTypeObject BookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvshare._native._pending.Book",
    .tp_basicsize = sizeof(Book),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "router.pending.PendingBlocks' book in C (see the module docstring).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)book_init,
    .tp_dealloc = (destructor)book_dealloc,
    .tp_methods = book_methods,
    .tp_members = book_members,
    .tp_as_sequence = &book_as_seq,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvshare._native._pending",
                                    "The router's pending blocks in C (router.pending).", -1,
                                    NULL};

PyMODINIT_FUNC PyInit__pending(void)
{
    if (PyType_Ready(&BookType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "Book", (PyObject *)&BookType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
