/* kvshare._hashq: checksum blocks in a native thread while the caller keeps copying.
 *
 * bind(path) -> bool
 *
 *     Find ``XXH3_64bits`` in the already loaded shared library at ``path`` (the ``xxhash``
 *     package's extension, the library that computes every block checksum kvshare stores) and
 *     use it from now on. False (and nothing bound) where the library does not export it.
 *
 * HashQueue(capacity)
 *
 *     Starts one thread. ``push(addr, nbytes)`` queues a buffer (returns its position);
 *     the thread computes its xxh3-64 without the GIL, in push order. ``wait(timeout_s)``
 *     releases the GIL, waits until every pushed buffer is hashed and returns their digests
 *     in push order, or None when ``timeout_s`` passed first. ``close()`` stops the thread
 *     after the buffer it is hashing (queued ones are skipped) and joins it: after ``close``
 *     (or a ``wait`` that returned digests) the thread reads no buffer any more.
 *
 * Why: a NIXL READ over UCX ``cma`` copies inside the call that posts it, holding the GIL, so a
 * Python thread cannot hash the blocks that already landed while the next ones copy; a block
 * hashed right after it landed is still in the cache (about twice as fast as from memory).
 * The caller keeps every pushed buffer alive and unchanged until ``wait`` returned digests
 * or ``close`` returned.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

typedef uint64_t (*xxh3_fn)(const void *, size_t);
static xxh3_fn xxh3 = NULL;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int running, stop;
    Py_ssize_t cap, pushed, done;
    const char **addr;
    size_t *len;
    uint64_t *out;
} HashQueue;

static void *worker(void *arg)
{
    HashQueue *q = (HashQueue *)arg;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (!q->stop && q->done == q->pushed)
            pthread_cond_wait(&q->cv, &q->mu);
        if (q->stop)
            break;
        Py_ssize_t i = q->done;
        pthread_mutex_unlock(&q->mu);
        uint64_t h = xxh3(q->addr[i], q->len[i]);
        pthread_mutex_lock(&q->mu);
        q->out[i] = h;
        q->done = i + 1;
        pthread_cond_broadcast(&q->cv);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

static void stop_thread(HashQueue *q)
{
    if (!q->running)
        return;
    pthread_mutex_lock(&q->mu);
    q->stop = 1;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(q->thread, NULL);
    Py_END_ALLOW_THREADS
    q->running = 0;
}

static int hq_init(HashQueue *q, PyObject *args, PyObject *kw)
{
    Py_ssize_t cap;
    if (!PyArg_ParseTuple(args, "n", &cap))
        return -1;
    if (xxh3 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvshare._native._hashq: call bind() first");
        return -1;
    }
    if (cap <= 0 || q->running || q->addr != NULL) {
        PyErr_SetString(PyExc_ValueError, "HashQueue needs a positive capacity (once)");
        return -1;
    }
    q->addr = PyMem_Calloc((size_t)cap, sizeof(*q->addr));
    q->len = PyMem_Calloc((size_t)cap, sizeof(*q->len));
    q->out = PyMem_Calloc((size_t)cap, sizeof(*q->out));
    if (q->addr == NULL || q->len == NULL || q->out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    q->cap = cap;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    if (pthread_create(&q->thread, NULL, worker, q) != 0) {
        PyErr_SetString(PyExc_OSError, "HashQueue: cannot start a thread");
        return -1;
    }
    q->running = 1;
    return 0;
}

static PyObject *hq_push(HashQueue *q, PyObject *args)
{
    unsigned long long addr;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "Kn", &addr, &n))
        return NULL;
    if (!q->running || n < 0 || addr == 0) {
        PyErr_SetString(PyExc_ValueError, "HashQueue.push: closed queue, or a bad buffer");
        return NULL;
    }
    pthread_mutex_lock(&q->mu);
    Py_ssize_t i = q->pushed;
    if (i < q->cap) {
        q->addr[i] = (const char *)(uintptr_t)addr;
        q->len[i] = (size_t)n;
        q->pushed = i + 1;
        pthread_cond_broadcast(&q->cv);
    }
    pthread_mutex_unlock(&q->mu);
    if (i >= q->cap) {
        PyErr_SetString(PyExc_ValueError, "HashQueue.push: more buffers than its capacity");
        return NULL;
    }
    return PyLong_FromSsize_t(i);
}

static PyObject *hq_wait(HashQueue *q, PyObject *args)
{
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout))
        return NULL;
    if (!q->running) {
        PyErr_SetString(PyExc_ValueError, "HashQueue.wait: closed queue");
        return NULL;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    double secs = timeout > 0 ? timeout : 0;
    until.tv_sec += (time_t)secs;
    until.tv_nsec += (long)((secs - (double)(time_t)secs) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->mu);
    int rc = 0;
    while (q->done < q->pushed && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&q->cv, &q->mu, &until);
    ok = q->done >= q->pushed;
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS
    if (!ok)
        Py_RETURN_NONE;
    PyObject *res = PyList_New(q->pushed);
    if (res == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < q->pushed; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(q->out[i]);
        if (v == NULL) {
            Py_DECREF(res);
            return NULL;
        }
        PyList_SET_ITEM(res, i, v);
    }
    return res;
}

static PyObject *hq_close(HashQueue *q, PyObject *unused)
{
    stop_thread(q);
    Py_RETURN_NONE;
}

static void hq_dealloc(HashQueue *q)
{
    stop_thread(q);
    if (q->addr != NULL) {
        pthread_mutex_destroy(&q->mu);
        pthread_cond_destroy(&q->cv);
    }
    PyMem_Free(q->addr);
    PyMem_Free(q->len);
    PyMem_Free(q->out);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static PyMethodDef hq_methods[] = {
    {"push", (PyCFunction)hq_push, METH_VARARGS, "push(addr, nbytes) -> position: queue a buffer."},
    {"wait", (PyCFunction)hq_wait, METH_VARARGS,
     "wait(timeout_s) -> digests in push order, or None on timeout."},
    {"close", (PyCFunction)hq_close, METH_NOARGS, "close(): stop and join the thread."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HashQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvshare._native._hashq.HashQueue",
    .tp_basicsize = sizeof(HashQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A native thread that xxh3-64s queued buffers (see _hashq.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hq_init,
    .tp_dealloc = (destructor)hq_dealloc,
    .tp_methods = hq_methods,
};

static PyObject *bind(PyObject *self, PyObject *args)
{
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        Py_RETURN_FALSE;
    xxh3_fn fn = (xxh3_fn)dlsym(lib, "XXH3_64bits");
    /* the library stays loaded: the xxhash module that loaded it is never unloaded */
    dlclose(lib);
    if (fn == NULL)
        Py_RETURN_FALSE;
    xxh3 = fn;
    Py_RETURN_TRUE;
}

static PyObject *digest(PyObject *self, PyObject *args)
{
    Py_buffer b;
    if (xxh3 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvshare._native._hashq: call bind() first");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "y*", &b))
        return NULL;
    uint64_t h = xxh3(b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(path) -> bool: use XXH3_64bits from the library at path."},
    {"digest", digest, METH_VARARGS, "digest(buffer) -> the bound xxh3-64 of buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvshare._native._hashq",
    "Checksums in a native thread (see _hashq.c).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hashq(void)
{
    if (PyType_Ready(&HashQueueType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&HashQueueType);
    if (PyModule_AddObject(m, "HashQueue", (PyObject *)&HashQueueType) < 0) {
        Py_DECREF(&HashQueueType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
