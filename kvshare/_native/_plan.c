/* kvshare._plan.scan: the cut-point scan of kvshare.cost.CostModel.plan_runs, in C.
 *
 *     scan(fetch, a, b, block_tokens, total_tokens, lat_remote, lat_local, runs)
 *         -> (best_k, best_total, best_fetch)
 *
 * The loop is _scan.h's (shared with kvshare._select): kvshare.cost._scan_py, operation for
 * operation in IEEE doubles (built with -ffp-contract=off: no fused multiply-add), so it
 * returns the very same floats; the tests
 * compare the two on random inputs. Anything outside the plain case (a, b, the latencies or a
 * fetch cost not exactly a float, a source outside ``fetch``, a token count that is not a
 * small positive int) raises TypeError/ValueError and the caller runs the Python loop instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_scan.h"

#define MAX_SOURCES 16

static int as_float(PyObject *o, double *out) { return scan_float(o, out, "scan"); }

static int as_count(PyObject *o, long long *out) { return scan_int(o, out, "scan", 0); }

static PyObject *scan(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *fetch_obj, *a_obj, *b_obj, *latr_obj, *latl_obj, *runs_obj;
    Py_ssize_t bt, p;
    if (!PyArg_ParseTuple(args, "OOOnnOOO:scan", &fetch_obj, &a_obj, &b_obj, &bt, &p, &latr_obj,
                          &latl_obj, &runs_obj))
        return NULL;
    double a, b, lat_r, lat_l, fetch[MAX_SOURCES];
    if (!PyTuple_CheckExact(fetch_obj) || PyTuple_GET_SIZE(fetch_obj) == 0
            || PyTuple_GET_SIZE(fetch_obj) > MAX_SOURCES) {
        PyErr_SetString(PyExc_TypeError, "scan needs fetch as a tuple of floats");
        return NULL;
    }
    Py_ssize_t n_src = PyTuple_GET_SIZE(fetch_obj);
    double max_fetch = 0.0;
    for (Py_ssize_t s = 0; s < n_src; s++) {
        if (as_float(PyTuple_GET_ITEM(fetch_obj, s), &fetch[s]) < 0)
            return NULL;
        /* Python's max(): the first of equals, NaN compares false */
        if (s == 0 || fetch[s] > max_fetch)
            max_fetch = fetch[s];
    }
    if (as_float(a_obj, &a) < 0 || as_float(b_obj, &b) < 0 || as_float(latr_obj, &lat_r) < 0
            || as_float(latl_obj, &lat_l) < 0)
        return NULL;
    if (bt <= 0 || p <= 0 || bt > (1LL << 30) || p > (1LL << 30)) {
        PyErr_SetString(PyExc_ValueError, "scan needs small positive token counts");
        return NULL;
    }
    PyObject *runs = PySequence_Fast(runs_obj, "runs must be a sequence of (source, count)");
    if (runs == NULL)
        return NULL;
    Py_ssize_t n_runs = PySequence_Fast_GET_SIZE(runs);
    PyObject **items = PySequence_Fast_ITEMS(runs);
    long long *src = PyMem_Malloc((size_t)(n_runs + 1) * 2 * sizeof(long long));
    if (src == NULL) {
        Py_DECREF(runs);
        return PyErr_NoMemory();
    }
    long long *len = src + n_runs + 1;
    for (Py_ssize_t r = 0; r < n_runs; r++) {
        PyObject *run = items[r];
        if (!PyTuple_CheckExact(run) || PyTuple_GET_SIZE(run) != 2) {
            PyErr_SetString(PyExc_TypeError, "scan needs runs of (source, count) tuples");
            goto fail;
        }
        if (as_count(PyTuple_GET_ITEM(run, 0), &src[r]) < 0
                || as_count(PyTuple_GET_ITEM(run, 1), &len[r]) < 0)
            goto fail;
        if (src[r] < 0 || src[r] >= n_src) {
            PyErr_SetString(PyExc_ValueError, "scan: source outside fetch");
            goto fail;
        }
    }
    ScanResult best = scan_runs(fetch, max_fetch, a, b, bt, p, lat_r, lat_l, src, len, n_runs);
    PyMem_Free(src);
    Py_DECREF(runs);
    return Py_BuildValue("Ldd", best.k, best.total, best.fetch);
fail:
    PyMem_Free(src);
    Py_DECREF(runs);
    return NULL;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(fetch, a, b, block_tokens, total_tokens, lat_remote, lat_local, runs) -> "
     "(best_k, best_total, best_fetch): kvshare.cost._scan_py in C (same floats)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvshare._native._plan",
                                    "The cost model's cut-point scan in C (kvshare.cost).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__plan(void) { return PyModule_Create(&module); }
