/* kvshare._ready.Book: router.ready.ReadyBlocks in C (the same entries, order and answers).
 *
 *     Book(max_entries, local_gpu, remote_host)    # the Source codes extend answers with
 *     book.add(namespace, worker, hashes, ready_s, now, stored_from=0)
 *     book.run_from(namespace, hashes, start) -> int
 *     book.extend(runs, namespace, hashes, worker, now, start_s) -> (runs, start_s)
 *     book.entries() -> [(namespace, hash, worker, ready_s, pullable), ...] in drop order
 *     book.forget(worker)                          # its entries go
 *     len(book)
 *
 * Per (namespace, hash): the worker creating the block, when it is stored, the number of the
 * add call that set it and whether other workers can pull it; kept in the order they were set
 * (a block set again moves to the end), dropped from the front once stored or past
 * max_entries. router/ready.py is the reference, step for step; the tests run both on random
 * sequences.
 */
#include "_ready.h"

typedef ReadyBook Book;


static void drop_stored(Book *self, double now)
{
    BkTable *t = &self->t;
    while (t->head != BK_NONE && !(t->e[t->head].t > now))
        bk_remove(t, t->head);
}

static PyObject *book_add(Book *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"namespace", "worker", "hashes", "ready_s", "now", "stored_from", NULL};
    PyObject *ns_obj, *w_obj, *hashes_obj;
    double ready_s, now;
    Py_ssize_t stored_from = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "UUOdd|n:add", kw, &ns_obj, &w_obj, &hashes_obj,
                                     &ready_s, &now, &stored_from))
        return NULL;
    PyObject *hashes = PySequence_Fast(hashes_obj, "hashes must be a sequence of bytes");
    if (!hashes)
        return NULL;
    BkTable *t = &self->t;
    if (t->size)
        drop_stored(self, now);
    Py_ssize_t ns = bk_intern(self->ns_ids, self->ns_names, ns_obj, 1);
    Py_ssize_t w = bk_intern(self->w_ids, self->w_names, w_obj, 1);
    if (ns < 0 || w < 0) {
        Py_DECREF(hashes);
        return NULL;
    }
    self->calls++;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    Py_ssize_t cut = stored_from >= 0 ? stored_from : n; /* (negative: none stored) */
    bk_prefetch(t, (uint32_t)ns, items, n);
    for (Py_ssize_t k = 0; k < n; k++) {
        const uint8_t *key;
        Py_ssize_t klen;
        if (bk_key(items[k], &key, &klen) < 0)
            goto fail;
        int32_t i = bk_find(t, (uint32_t)ns, key, klen);
        if (i == BK_NONE) {
            i = bk_insert(t, (uint32_t)ns, key, klen);
            if (i < 0)
                goto fail;
        } else if (t->e[i].t > ready_s) {
            bk_to_end(t, i);
        } else {
            continue;
        }
        BkEntry *e = &t->e[i];
        e->a = (int32_t)w;
        e->t = ready_s;
        e->call = self->calls;
        e->b = k >= cut;
    }
    while (t->size > self->max)
        bk_remove(t, t->head);
    Py_DECREF(hashes);
    Py_RETURN_NONE;
fail:
    Py_DECREF(hashes);
    return NULL;
}

/* ReadyBlocks.forget: drop every entry ``worker`` was creating (its queue and cache are gone);
 * the others and their order stay. */
static PyObject *book_forget(Book *self, PyObject *args)
{
    PyObject *w_obj;
    if (!PyArg_ParseTuple(args, "U:forget", &w_obj))
        return NULL;
    Py_ssize_t w = bk_intern(self->w_ids, self->w_names, w_obj, 0);
    if (w == -2)
        return NULL;
    BkTable *t = &self->t;
    for (int32_t i = t->head; w >= 0 && i != BK_NONE;) {
        int32_t next = t->e[i].next;
        if (t->e[i].a == (int32_t)w)
            bk_remove(t, i);
        i = next;
    }
    Py_RETURN_NONE;
}

static PyObject *book_run_from(Book *self, PyObject *args)
{
    PyObject *ns_obj, *hashes_obj;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "UOn:run_from", &ns_obj, &hashes_obj, &start))
        return NULL;
    Py_ssize_t ns = bk_intern(self->ns_ids, self->ns_names, ns_obj, 0);
    if (ns == -2)
        return NULL;
    if (ns < 0)
        return PyLong_FromLong(0);
    PyObject *hashes = PySequence_Fast(hashes_obj, "hashes must be a sequence of bytes");
    if (!hashes)
        return NULL;
    if (start < 0) {
        Py_DECREF(hashes);
        PyErr_SetString(PyExc_ValueError, "run_from needs start >= 0");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes), k = start;
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    for (; k < n; k++) {
        const uint8_t *key;
        Py_ssize_t klen;
        if (bk_key(items[k], &key, &klen) < 0) {
            Py_DECREF(hashes);
            return NULL;
        }
        if (bk_find(&self->t, (uint32_t)ns, key, klen) == BK_NONE)
            break;
    }
    Py_DECREF(hashes);
    return PyLong_FromSsize_t(k > start ? k - start : 0);
}

static PyObject *book_extend(Book *self, PyObject *args)
{
    PyObject *runs_obj, *ns_obj, *hashes_obj, *w_obj, *start_obj;
    double now;
    if (!PyArg_ParseTuple(args, "OUOUdO:extend", &runs_obj, &ns_obj, &hashes_obj, &w_obj, &now,
                          &start_obj))
        return NULL;
    double start_s = PyFloat_AsDouble(start_obj);
    if (start_s == -1.0 && PyErr_Occurred())
        return NULL;
    Py_ssize_t ns = -1;
    if (self->t.size) {
        ns = bk_intern(self->ns_ids, self->ns_names, ns_obj, 0);
        if (ns == -2)
            return NULL;
    }
    if (ns < 0 || !bk_ns_size(&self->t, (uint32_t)ns))
        return PyTuple_Pack(2, runs_obj, start_obj);
    Py_ssize_t w = bk_intern(self->w_ids, self->w_names, w_obj, 0);
    if (w == -2)
        return NULL;
    PyObject *runs = PySequence_Fast(runs_obj, "runs must be a sequence of (source, count)");
    if (!runs)
        return NULL;
    PyObject *hashes = PySequence_Fast(hashes_obj, "hashes must be a sequence of bytes");
    if (!hashes) {
        Py_DECREF(runs);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t n_in = PySequence_Fast_GET_SIZE(runs), n_out = 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    SrcRun *buf = (SrcRun *)malloc((size_t)(n_in + n + 1) * sizeof(SrcRun));
    if (!buf) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t covered = 0;
    for (Py_ssize_t r = 0; r < n_in; r++) {
        PyObject *run = PySequence_Fast_GET_ITEM(runs, r);
        if (!PyTuple_Check(run) || PyTuple_GET_SIZE(run) != 2) {
            PyErr_SetString(PyExc_TypeError, "runs must be (source, count) tuples");
            goto done;
        }
        long src = PyLong_AsLong(PyTuple_GET_ITEM(run, 0));
        Py_ssize_t cnt = PyLong_AsSsize_t(PyTuple_GET_ITEM(run, 1));
        if ((src == -1 || cnt == -1) && PyErr_Occurred())
            goto done;
        buf[n_out++] = (SrcRun){src, cnt};
        covered += cnt;
    }
    double begin = start_s;
    Py_ssize_t k = ready_extend(self, (uint32_t)ns, (int32_t)w, PySequence_Fast_ITEMS(hashes), n,
                                covered, now, start_s, buf, &n_out, &begin);
    if (k < 0)
        goto done;
    if (k == covered) {
        out = PyTuple_Pack(2, runs_obj, start_obj);
        goto done;
    }
    PyObject *tup = PyTuple_New(n_out);
    if (!tup)
        goto done;
    for (Py_ssize_t r = 0; r < n_out; r++) {
        PyObject *run = Py_BuildValue("(ln)", buf[r].src, buf[r].n);
        if (!run) {
            Py_DECREF(tup);
            goto done;
        }
        PyTuple_SET_ITEM(tup, r, run);
    }
    out = Py_BuildValue("(Nd)", tup, begin);
done:
    free(buf);
    Py_DECREF(runs);
    Py_DECREF(hashes);
    return out;
}

static PyObject *book_entries(Book *self, PyObject *unused)
{
    (void)unused;
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    for (int32_t i = self->t.head; i != BK_NONE; i = self->t.e[i].next) {
        const BkEntry *e = &self->t.e[i];
        PyObject *row = Py_BuildValue("(Oy#OdO)", PyList_GET_ITEM(self->ns_names, e->ns),
                                      (const char *)e->key, (Py_ssize_t)e->klen,
                                      PyList_GET_ITEM(self->w_names, e->a), e->t,
                                      e->b ? Py_True : Py_False);
        if (!row || PyList_Append(list, row) < 0) {
            Py_XDECREF(row);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(row);
    }
    return list;
}

static Py_ssize_t book_len(Book *self) { return self->t.size; }

static int book_init(Book *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"max_entries", "local_gpu", "remote_host", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nll:Book", kw, &self->max, &self->local_src,
                                     &self->remote_src))
        return -1;
    if (self->ns_ids) {
        PyErr_SetString(PyExc_RuntimeError, "Book is initialised once");
        return -1;
    }
    self->ns_ids = PyDict_New();
    self->ns_names = PyList_New(0);
    self->w_ids = PyDict_New();
    self->w_names = PyList_New(0);
    if (!self->ns_ids || !self->ns_names || !self->w_ids || !self->w_names)
        return -1;
    if (bk_init(&self->t) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void book_dealloc(Book *self)
{
    bk_free(&self->t);
    Py_XDECREF(self->ns_ids);
    Py_XDECREF(self->ns_names);
    Py_XDECREF(self->w_ids);
    Py_XDECREF(self->w_names);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef book_methods[] = {
    {"forget", (PyCFunction)book_forget, METH_VARARGS,
     "forget(worker): drop every block worker was creating (its queue and cache are gone)."},
    {"add", (PyCFunction)(void (*)(void))book_add, METH_VARARGS | METH_KEYWORDS,
     "add(namespace, worker, hashes, ready_s, now, stored_from=0): ReadyBlocks.add."},
    {"run_from", (PyCFunction)book_run_from, METH_VARARGS,
     "run_from(namespace, hashes, start) -> int: ReadyBlocks.run_from."},
    {"extend", (PyCFunction)book_extend, METH_VARARGS,
     "extend(runs, namespace, hashes, worker, now, start_s) -> (runs, start): ReadyBlocks.extend."},
    {"entries", (PyCFunction)book_entries, METH_NOARGS,
     "entries() -> [(namespace, hash, worker, ready_s, pullable)] in the order they go."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods book_as_seq = {.sq_length = (lenfunc)book_len};

static PyTypeObject BookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvshare._native._ready.Book",
    .tp_basicsize = sizeof(Book),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "router.ready.ReadyBlocks' book in C (see the module docstring).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)book_init,
    .tp_dealloc = (destructor)book_dealloc,
    .tp_methods = book_methods,
    .tp_as_sequence = &book_as_seq,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvshare._native._ready",
                                    "The router's ready blocks in C (router.ready).", -1, NULL};

PyMODINIT_FUNC PyInit__ready(void)
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
