/* kvshare._select.select: the cost policy's candidate loop (router.policy.CostPolicy._select),
 * with the per-worker view it reads (router.sources.SourceMap), in one C call.
 *
 *     select(index_runs, pending_runs, roster, loc_node, node_of, private, queues, order,
 *            bound, typical, work, ready, namespace, hashes, now, tokens, fetch, a, b,
 *            block_tokens, lat_remote, lat_local, tie_s, remote)
 *         -> (ests, [(i, runs, best_k, best_total, best_fetch), ...])
 *
 * - ``index_runs``, ``pending_runs``: the index's match and the router's pending blocks in run
 *   form, ``[(((location, tier code), ...), count), ...]``.
 * - ``roster``: per candidate ``(worker locations, node locations, node ids, worker ids)`` (four
 *   lists); ``loc_node``: location -> node id (a holder's node; ``node_of(location)`` fills a
 *   miss); ``private``: locations no other worker may read.
 * - ``queues``, ``order``: each candidate's queue wait and the candidates by increasing wait;
 *   ``bound``/``typical`` (lists or None) and ``work``: the policy's price of a second of plan.
 * - ``ready``: the policy's kvshare._ready.Book or None; ``now``: the policy's clock.
 * - the cost model: ``tokens`` of the prompt, ``fetch`` seconds per block by source, the
 *   prefill's ``a``, ``b``, ``block_tokens``, the remote/local latencies; ``tie_s``; ``remote``:
 *   global sharing (other nodes' blocks count).
 *
 * Returns every candidate's estimate (inf where pruned) and, for each candidate whose plan was
 * computed, in the order the Python loop computes them: its index, its runs (the SourceRuns
 * the Python view gives it, ready blocks appended) and the cut-point scan of those runs.
 * Step for step the Python code's, in IEEE doubles with -ffp-contract=off, so the same floats
 * and the same pruning; tests/test_router_fastpaths.py routes both in lockstep. Anything
 * outside the plain case (a number that is not an exact float or a small int, a source outside
 * ``fetch``) raises TypeError/ValueError before any state changes: the caller then runs Python.
 */
#include "_ready.h"
#include "_scan.h"

#define NONE_RANK 9 /* router.sources._NONE */
#define FAR 3       /* kvshare.cost.REMOTE_OFFSET: tier code -> its remote Source */
#define MAX_SOURCES 16
#define SHRINK (1.0 - 1e-9) /* router.policy._SHRINK */

static PyTypeObject *ReadyType;

typedef struct {
    PyObject *loc;
    Py_hash_t hash;
    int rank;
    long node;  /* node id of the holder (index holders only) */
    int usable; /* not private (index holders only) */
} Hold;

typedef struct {
    Py_ssize_t off, n; /* holders: holds[off .. off + n) */
    Py_ssize_t count;
} Run;

typedef struct {
    Hold *holds;
    Py_ssize_t n_holds, cap_holds;
    Run *runs;
    Py_ssize_t n_runs;
    Py_ssize_t total;
} Runs;

static int exact_float(PyObject *o, double *out) { return scan_float(o, out, "select"); }

static int small_int(PyObject *o, long long *out) { return scan_int(o, out, "select", 1); }

static void runs_free(Runs *r)
{
    free(r->holds);
    free(r->runs);
}

/* Parse runs [(holders, count), ...]; index holders also get their node and usability. */
static int runs_read(Runs *r, PyObject *obj, int index, PyObject *loc_node, PyObject *node_of,
                     PyObject *private)
{
    memset(r, 0, sizeof(*r));
    PyObject *seq = PySequence_Fast(obj, "runs must be a sequence");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    r->runs = (Run *)malloc((size_t)(n + 1) * sizeof(Run));
    if (!r->runs)
        goto nomem;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *run = PySequence_Fast_GET_ITEM(seq, j);
        if (!PyTuple_Check(run) || PyTuple_GET_SIZE(run) != 2) {
            PyErr_SetString(PyExc_TypeError, "runs must be (holders, count) tuples");
            goto fail;
        }
        long long count;
        if (small_int(PyTuple_GET_ITEM(run, 1), &count) < 0)
            goto fail;
        PyObject *hs = PySequence_Fast(PyTuple_GET_ITEM(run, 0), "holders must be a sequence");
        if (!hs)
            goto fail;
        Py_ssize_t m = PySequence_Fast_GET_SIZE(hs);
        if (r->n_holds + m > r->cap_holds) {
            r->cap_holds = (r->n_holds + m) * 2 + 16;
            Hold *h = (Hold *)realloc(r->holds, (size_t)r->cap_holds * sizeof(Hold));
            if (!h) {
                Py_DECREF(hs);
                goto nomem;
            }
            r->holds = h;
        }
        for (Py_ssize_t x = 0; x < m; x++) {
            PyObject *pair = PySequence_Fast_GET_ITEM(hs, x);
            long long rank;
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2
                    || !PyUnicode_Check(PyTuple_GET_ITEM(pair, 0))) {
                PyErr_SetString(PyExc_TypeError, "holders must be (location, tier code) tuples");
                Py_DECREF(hs);
                goto fail;
            }
            if (small_int(PyTuple_GET_ITEM(pair, 1), &rank) < 0 || rank < 0
                    || (rank > 2 && rank != NONE_RANK)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "tier codes are 0..2 (or 9: none)");
                Py_DECREF(hs);
                goto fail;
            }
            Hold *h = &r->holds[r->n_holds + x];
            h->loc = PyTuple_GET_ITEM(pair, 0);
            h->hash = PyObject_Hash(h->loc);
            h->rank = (int)rank;
            h->node = -1;
            h->usable = 1;
            if (index && rank != NONE_RANK) {
                int priv = PySet_GET_SIZE(private) ? PySet_Contains(private, h->loc) : 0;
                if (priv < 0) {
                    Py_DECREF(hs);
                    goto fail;
                }
                h->usable = !priv;
                if (h->usable) {
                    PyObject *node = PyDict_GetItemWithError(loc_node, h->loc);
                    if (!node && !PyErr_Occurred())
                        node = PyObject_CallOneArg(node_of, h->loc);
                    else
                        Py_XINCREF(node);
                    if (!node) {
                        Py_DECREF(hs);
                        goto fail;
                    }
                    h->node = PyLong_AsLong(node);
                    Py_DECREF(node);
                    if (h->node == -1 && PyErr_Occurred()) {
                        Py_DECREF(hs);
                        goto fail;
                    }
                }
            }
        }
        Py_DECREF(hs);
        r->runs[j] = (Run){r->n_holds, m, (Py_ssize_t)count};
        r->n_holds += m;
        r->total += (Py_ssize_t)count;
        r->n_runs++;
    }
    Py_DECREF(seq);
    return 0;
nomem:
    PyErr_NoMemory();
fail:
    Py_DECREF(seq);
    return -1;
}

static int cmp_ssize(const void *x, const void *y)
{
    Py_ssize_t a = *(const Py_ssize_t *)x, b = *(const Py_ssize_t *)y;
    return (a > b) - (a < b);
}

/* The run of ``r`` covering each segment start (-1: past the runs), as _per_segment. */
static void per_segment(const Runs *r, const Py_ssize_t *starts, Py_ssize_t n_seg, Py_ssize_t *out)
{
    Py_ssize_t run = -1, end = 0;
    for (Py_ssize_t j = 0; j < n_seg; j++) {
        while (starts[j] >= end) {
            run++;
            if (run >= r->n_runs) {
                end = (Py_ssize_t)1 << 62;
                run = -1;
                break;
            }
            end += r->runs[run].count;
        }
        out[j] = run;
    }
}

static inline int same_loc(const Hold *h, PyObject *loc, Py_hash_t hash)
{
    if (h->loc == loc)
        return 1;
    if (h->hash != hash)
        return 0;
    return PyUnicode_Compare(h->loc, loc) == 0;
}

typedef struct {
    double low, wait;
    Py_ssize_t pos, i, off, n; /* its runs: sbuf[off .. off + n) */
} Entry;

static int cmp_entry(const void *x, const void *y)
{
    const Entry *a = (const Entry *)x, *b = (const Entry *)y;
    if (a->low < b->low)
        return -1;
    if (a->low > b->low)
        return 1;
    return (a->pos > b->pos) - (a->pos < b->pos);
}

static inline double work_s(double t, double work, const double *bound, const double *typical,
                            Py_ssize_t i)
{
    if (!bound)
        return work * t;
    double over = t - typical[i];
    return (work + bound[i] * (over > 0.0 ? over : 0.0)) * t;
}

static int float_list(PyObject *obj, Py_ssize_t n, double **out)
{
    *out = NULL;
    if (obj == Py_None)
        return 0;
    if (!PyList_Check(obj) || PyList_GET_SIZE(obj) != n) {
        PyErr_SetString(PyExc_TypeError, "select needs a list of floats per candidate");
        return -1;
    }
    double *v = (double *)malloc((size_t)(n + 1) * sizeof(double));
    if (!v) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (exact_float(PyList_GET_ITEM(obj, i), &v[i]) < 0) {
            free(v);
            return -1;
        }
    }
    *out = v;
    return 0;
}

static PyObject *select_(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 24) {
        PyErr_SetString(PyExc_TypeError, "select takes 24 arguments");
        return NULL;
    }
    PyObject *index_obj = args[0], *pending_obj = args[1], *roster = args[2];
    PyObject *loc_node = args[3], *node_of = args[4], *private = args[5];
    PyObject *queues_obj = args[6], *order_obj = args[7], *bound_obj = args[8];
    PyObject *typical_obj = args[9], *ready_obj = args[11], *ns_obj = args[12];
    PyObject *hashes_obj = args[13], *fetch_obj = args[16];
    double work, now, a, b, lat_r, lat_l, tie;
    long long p, bt;
    if (exact_float(args[10], &work) < 0 || exact_float(args[14], &now) < 0
            || small_int(args[15], &p) < 0 || exact_float(args[17], &a) < 0
            || exact_float(args[18], &b) < 0 || small_int(args[19], &bt) < 0
            || exact_float(args[20], &lat_r) < 0 || exact_float(args[21], &lat_l) < 0
            || exact_float(args[22], &tie) < 0)
        return NULL;
    int remote = PyObject_IsTrue(args[23]);
    if (remote < 0)
        return NULL;
    if (p <= 0 || bt <= 0 || p > (1LL << 30) || bt > (1LL << 30)) {
        PyErr_SetString(PyExc_ValueError, "select needs small positive token counts");
        return NULL;
    }
    if (!PyDict_Check(loc_node) || !PyAnySet_Check(private) || !PyUnicode_Check(ns_obj)
            || !PyTuple_Check(roster) || PyTuple_GET_SIZE(roster) != 4
            || !PyList_Check(queues_obj) || !PyList_Check(order_obj)) {
        PyErr_SetString(PyExc_TypeError, "select: bad argument types");
        return NULL;
    }
    if (ready_obj != Py_None && !PyObject_TypeCheck(ready_obj, ReadyType)) {
        PyErr_SetString(PyExc_TypeError, "select reads a kvshare._ready.Book only");
        return NULL;
    }
    const ReadyBook *ready = ready_obj == Py_None ? NULL : (const ReadyBook *)ready_obj;
    PyObject *w_locs = PyTuple_GET_ITEM(roster, 0), *n_locs = PyTuple_GET_ITEM(roster, 1);
    PyObject *nodes_obj = PyTuple_GET_ITEM(roster, 2), *wids = PyTuple_GET_ITEM(roster, 3);
    Py_ssize_t nc = PyList_GET_SIZE(queues_obj);
    if (!PyList_Check(w_locs) || !PyList_Check(n_locs) || !PyList_Check(nodes_obj)
            || !PyList_Check(wids) || PyList_GET_SIZE(w_locs) != nc
            || PyList_GET_SIZE(n_locs) != nc || PyList_GET_SIZE(nodes_obj) != nc
            || PyList_GET_SIZE(wids) != nc || PyList_GET_SIZE(order_obj) != nc || nc == 0) {
        PyErr_SetString(PyExc_TypeError, "select: one roster entry per candidate");
        return NULL;
    }
    double fetch[MAX_SOURCES], max_fetch = 0.0;
    if (!PyTuple_CheckExact(fetch_obj) || PyTuple_GET_SIZE(fetch_obj) == 0
            || PyTuple_GET_SIZE(fetch_obj) > MAX_SOURCES) {
        PyErr_SetString(PyExc_TypeError, "select needs fetch as a tuple of floats");
        return NULL;
    }
    Py_ssize_t n_src = PyTuple_GET_SIZE(fetch_obj);
    if (n_src < FAR + 3) {
        PyErr_SetString(PyExc_ValueError, "select needs a fetch cost for every source");
        return NULL;
    }
    for (Py_ssize_t s = 0; s < n_src; s++) {
        if (exact_float(PyTuple_GET_ITEM(fetch_obj, s), &fetch[s]) < 0)
            return NULL;
        if (s == 0 || fetch[s] > max_fetch)
            max_fetch = fetch[s];
    }
    PyObject *hashes = PySequence_Fast(hashes_obj, "hashes must be a sequence of bytes");
    if (!hashes)
        return NULL;
    Py_ssize_t n_hashes = PySequence_Fast_GET_SIZE(hashes);
    PyObject **hitems = PySequence_Fast_ITEMS(hashes);

    PyObject *out = NULL, *ests_list = NULL, *evaluated = NULL;
    Runs idx = {0}, mine = {0};
    double *queues = NULL, *bound = NULL, *typical = NULL, *ests = NULL;
    Py_ssize_t *order = NULL, *starts = NULL, *lens = NULL, *idx_run = NULL, *mine_run = NULL;
    int *best1 = NULL, *best2 = NULL, *own = NULL;
    long *best1_node = NULL, *cnode = NULL;
    SrcRun *sbuf = NULL;
    Entry *group = NULL;
    long long *scan_src = NULL;

    if (runs_read(&idx, index_obj, 1, loc_node, node_of, private) < 0
            || runs_read(&mine, pending_obj, 0, loc_node, node_of, private) < 0)
        goto done;
    if (float_list(queues_obj, nc, &queues) < 0 || float_list(bound_obj, nc, &bound) < 0
            || float_list(typical_obj, nc, &typical) < 0)
        goto done;
    if ((bound == NULL) != (typical == NULL)) {
        PyErr_SetString(PyExc_TypeError, "select needs bound and typical together");
        goto done;
    }
    order = (Py_ssize_t *)malloc((size_t)nc * sizeof(Py_ssize_t));
    cnode = (long *)malloc((size_t)nc * sizeof(long));
    ests = (double *)malloc((size_t)nc * sizeof(double));
    group = (Entry *)malloc((size_t)nc * sizeof(Entry));
    if (!order || !cnode || !ests || !group) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t x = 0; x < nc; x++) {
        long long o, nd;
        if (small_int(PyList_GET_ITEM(order_obj, x), &o) < 0
                || small_int(PyList_GET_ITEM(nodes_obj, x), &nd) < 0)
            goto done;
        if (o < 0 || o >= nc) {
            PyErr_SetString(PyExc_ValueError, "select: order outside the candidates");
            goto done;
        }
        order[x] = (Py_ssize_t)o;
        cnode[x] = (long)nd;
        ests[x] = Py_HUGE_VAL;
        if (!PyUnicode_Check(PyList_GET_ITEM(w_locs, x))
                || !PyUnicode_Check(PyList_GET_ITEM(n_locs, x))) {
            PyErr_SetString(PyExc_TypeError, "select: locations are str");
            goto done;
        }
    }

    /* SourceMap.__init__: segments where any index or pending run ends */
    Py_ssize_t n_bounds = 1 + idx.n_runs + mine.n_runs;
    starts = (Py_ssize_t *)malloc((size_t)(n_bounds + 1) * sizeof(Py_ssize_t));
    if (!starts) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t nb = 0;
    starts[nb++] = 0;
    for (int which = 0; which < 2; which++) {
        const Runs *r = which ? &mine : &idx;
        Py_ssize_t pos = 0;
        for (Py_ssize_t j = 0; j < r->n_runs; j++) {
            pos += r->runs[j].count;
            starts[nb++] = pos;
        }
    }
    qsort(starts, (size_t)nb, sizeof(Py_ssize_t), cmp_ssize);
    Py_ssize_t n_seg = 0; /* unique bounds below the combined prefix */
    Py_ssize_t combined = starts[nb - 1];
    for (Py_ssize_t j = 0; j < nb; j++) {
        if (starts[j] < combined && (n_seg == 0 || starts[j] != starts[n_seg - 1]))
            starts[n_seg++] = starts[j];
    }
    if (!combined)
        n_seg = 0;
    Py_ssize_t seg_alloc = n_seg + 1;
    lens = (Py_ssize_t *)malloc((size_t)seg_alloc * sizeof(Py_ssize_t));
    idx_run = (Py_ssize_t *)malloc((size_t)seg_alloc * sizeof(Py_ssize_t));
    mine_run = (Py_ssize_t *)malloc((size_t)seg_alloc * sizeof(Py_ssize_t));
    best1 = (int *)malloc((size_t)seg_alloc * sizeof(int));
    best2 = (int *)malloc((size_t)seg_alloc * sizeof(int));
    own = (int *)malloc((size_t)seg_alloc * sizeof(int));
    best1_node = (long *)malloc((size_t)seg_alloc * sizeof(long));
    if (!lens || !idx_run || !mine_run || !best1 || !best2 || !own || !best1_node) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < n_seg; j++)
        lens[j] = (j + 1 < n_seg ? starts[j + 1] : combined) - starts[j];
    per_segment(&idx, starts, n_seg, idx_run);
    per_segment(&mine, starts, n_seg, mine_run);
    /* _bests: the best usable index holder's rank and node, and the best on any other node */
    for (Py_ssize_t j = 0; j < n_seg; j++) {
        int b1 = NONE_RANK, b2 = NONE_RANK, has_node = 0;
        long b1n = -1;
        if (idx_run[j] >= 0) {
            const Run *run = &idx.runs[idx_run[j]];
            for (Py_ssize_t x = 0; x < run->n; x++) {
                const Hold *h = &idx.holds[run->off + x];
                if (h->rank == NONE_RANK || !h->usable)
                    continue;
                if (has_node && b1n == h->node) {
                    if (h->rank < b1)
                        b1 = h->rank;
                } else if (h->rank < b1) {
                    b2 = b1;
                    b1 = h->rank;
                    b1n = h->node;
                    has_node = 1;
                } else if (h->rank < b2) {
                    b2 = h->rank;
                }
            }
        }
        best1[j] = b1;
        best1_node[j] = has_node ? b1n : -1;
        best2[j] = b2;
    }

    /* CostPolicy._select: the reach of any plan, the floor no plan beats */
    uint32_t ready_ns = 0;
    int ready_on = 0;
    if (ready && ready->t.size) {
        Py_ssize_t id = bk_intern(ready->ns_ids, ready->ns_names, ns_obj, 0);
        if (id == -2)
            goto done;
        if (id >= 0) {
            ready_ns = (uint32_t)id;
            ready_on = 1;
        }
    }
    Py_ssize_t reach = combined;
    if (ready) { /* ReadyBlocks.run_from(ns, hashes, combined) */
        Py_ssize_t k = combined;
        if (ready_on) {
            for (; k < n_hashes; k++) {
                const uint8_t *key;
                Py_ssize_t klen;
                if (bk_key(hitems[k], &key, &klen) < 0)
                    goto done;
                if (bk_find(&ready->t, ready_ns, key, klen) == BK_NONE)
                    break;
            }
            reach += k > combined ? k - combined : 0;
        }
    }
    long long c_max = (long long)reach * bt;
    if (c_max > p - 1)
        c_max = p - 1;
    if (c_max < 0)
        c_max = 0;
    long long m_max = p - c_max;
    double floor_s = a * (double)m_max + b * (double)m_max * ((double)c_max + (double)m_max / 2.0);
    double full = a * (double)p + b * (double)p * (double)p / 2.0;

    sbuf = (SrcRun *)malloc((size_t)nc * (size_t)(n_seg + n_hashes + 1) * sizeof(SrcRun));
    scan_src = (long long *)malloc((size_t)(n_seg + n_hashes + 1) * 2 * sizeof(long long));
    if (!sbuf || !scan_src) {
        PyErr_NoMemory();
        goto done;
    }
    long long *scan_len = scan_src + n_seg + n_hashes + 1;
    evaluated = PyList_New(0);
    if (!evaluated)
        goto done;
    Py_ssize_t used = 0; /* sbuf entries taken */
    double best = Py_HUGE_VAL;
    Py_ssize_t pos = 0;
    while (pos < nc) {
        double q = queues[order[pos]];
        if (q + work * floor_s > best + tie)
            break;
        Py_ssize_t n_group = 0;
        while (pos < nc && queues[order[pos]] == q) {
            Py_ssize_t i = order[pos];
            /* SourceMap.source_runs: this worker's own ranks, then the cheapest source */
            PyObject *wl = PyList_GET_ITEM(w_locs, i), *nl = PyList_GET_ITEM(n_locs, i);
            Py_hash_t wh = PyObject_Hash(wl), nh = PyObject_Hash(nl);
            for (Py_ssize_t j = 0; j < n_seg; j++) {
                int iw = NONE_RANK, in = NONE_RANK, mn = NONE_RANK;
                if (idx_run[j] >= 0) {
                    const Run *run = &idx.runs[idx_run[j]];
                    for (Py_ssize_t x = 0; x < run->n; x++) { /* (the last one named wins) */
                        const Hold *h = &idx.holds[run->off + x];
                        if (same_loc(h, wl, wh))
                            iw = h->rank;
                        else if (same_loc(h, nl, nh))
                            in = h->rank;
                    }
                }
                if (mine_run[j] >= 0) {
                    const Run *run = &mine.runs[mine_run[j]];
                    for (Py_ssize_t x = 0; x < run->n; x++) {
                        const Hold *h = &mine.holds[run->off + x];
                        if ((same_loc(h, wl, wh) || same_loc(h, nl, nh)) && h->rank < mn)
                            mn = h->rank;
                    }
                }
                int s = iw < in ? iw : in;
                own[j] = mn < s ? mn : s;
            }
            if (PyErr_Occurred())
                goto done;
            Py_ssize_t off = used, n_out = 0;
            SrcRun *out_runs = &sbuf[off];
            for (Py_ssize_t j = 0; j < n_seg; j++) {
                int s = own[j];
                if (remote && s > 0) {
                    int r = best1_node[j] != cnode[i] ? best1[j] : best2[j];
                    if (r != NONE_RANK) {
                        if (s == NONE_RANK)
                            s = r + FAR;
                        else if (fetch[r + FAR] < fetch[s])
                            s = r + FAR;
                    }
                }
                if (s == NONE_RANK)
                    break;
                if (n_out && out_runs[n_out - 1].src == s)
                    out_runs[n_out - 1].n += lens[j];
                else
                    out_runs[n_out++] = (SrcRun){s, lens[j]};
            }
            double wait = q;
            if (ready) { /* ReadyBlocks.extend(runs, ns, hashes, worker, now, now + q) */
                double start_s = now + q, begin = start_s;
                if (ready_on && ready->t.size && bk_ns_size(&ready->t, ready_ns)) {
                    Py_ssize_t w = bk_intern(ready->w_ids, ready->w_names,
                                             PyList_GET_ITEM(wids, i), 0);
                    if (w == -2)
                        goto done;
                    Py_ssize_t covered = 0;
                    for (Py_ssize_t r = 0; r < n_out; r++)
                        covered += out_runs[r].n;
                    Py_ssize_t n_before = n_out;
                    Py_ssize_t k = ready_extend(ready, ready_ns, (int32_t)w, hitems, n_hashes,
                                                covered, now, start_s, out_runs, &n_out, &begin);
                    if (k < 0)
                        goto done;
                    if (k == covered) {
                        n_out = n_before;
                        begin = start_s;
                    }
                }
                wait = begin - now;
            }
            used += n_out;
            /* CostPolicy._bound: a lower bound of the plan's total */
            double t;
            if (!n_out) {
                t = full * SHRINK;
            } else {
                long src = out_runs[0].src;
                if (src < 0 || src >= n_src) {
                    PyErr_SetString(PyExc_ValueError, "select: source outside fetch");
                    goto done;
                }
                double lat = src >= 3 ? lat_r : (src ? lat_l : 0.0);
                long long blocks = 0;
                for (Py_ssize_t r = 0; r < n_out; r++)
                    blocks += out_runs[r].n;
                long long c = blocks * bt;
                if (c > p - 1)
                    c = p - 1;
                if (c < 0)
                    c = 0;
                long long m = p - c;
                double cut = fetch[src] + lat + a * (double)m + b * (double)m * ((double)c + (double)m / 2.0);
                t = (cut < full ? cut : full) * SHRINK;
            }
            group[n_group++] = (Entry){wait + work_s(t, work, bound, typical, i), wait, pos, i,
                                       off, n_out};
            pos++;
        }
        qsort(group, (size_t)n_group, sizeof(Entry), cmp_entry);
        for (Py_ssize_t g = 0; g < n_group; g++) {
            const Entry *e = &group[g];
            if (e->low > best + tie)
                break;
            for (Py_ssize_t r = 0; r < e->n; r++) {
                scan_src[r] = sbuf[e->off + r].src;
                scan_len[r] = sbuf[e->off + r].n;
            }
            ScanResult sc = scan_runs(fetch, max_fetch, a, b, bt, p, lat_r, lat_l, scan_src,
                                      scan_len, e->n);
            double total_s = sc.fetch + (sc.total - sc.fetch); /* CutPlan.total_s */
            ests[e->i] = e->wait + work_s(total_s, work, bound, typical, e->i);
            if (ests[e->i] < best)
                best = ests[e->i];
            PyObject *runs = PyTuple_New(e->n);
            if (!runs)
                goto done;
            for (Py_ssize_t r = 0; r < e->n; r++) {
                PyObject *pair = Py_BuildValue("(ln)", sbuf[e->off + r].src, sbuf[e->off + r].n);
                if (!pair) {
                    Py_DECREF(runs);
                    goto done;
                }
                PyTuple_SET_ITEM(runs, r, pair);
            }
            PyObject *row = Py_BuildValue("(nNLdd)", e->i, runs, sc.k, sc.total, sc.fetch);
            if (!row || PyList_Append(evaluated, row) < 0) {
                Py_XDECREF(row);
                goto done;
            }
            Py_DECREF(row);
        }
    }
    ests_list = PyList_New(nc);
    if (!ests_list)
        goto done;
    for (Py_ssize_t x = 0; x < nc; x++) {
        PyObject *v = PyFloat_FromDouble(ests[x]);
        if (!v)
            goto done;
        PyList_SET_ITEM(ests_list, x, v);
    }
    out = PyTuple_Pack(2, ests_list, evaluated);
done:
    Py_XDECREF(ests_list);
    Py_XDECREF(evaluated);
    runs_free(&idx);
    runs_free(&mine);
    free(queues);
    free(bound);
    free(typical);
    free(ests);
    free(order);
    free(cnode);
    free(starts);
    free(lens);
    free(idx_run);
    free(mine_run);
    free(best1);
    free(best2);
    free(own);
    free(best1_node);
    free(sbuf);
    free(group);
    free(scan_src);
    Py_DECREF(hashes);
    return out;
}

static PyMethodDef methods[] = {
    {"select", (PyCFunction)(void (*)(void))select_, METH_FASTCALL,
     "select(...) -> (ests, evaluated): CostPolicy._select's candidate loop (module docstring)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvshare._select",
                                    "The cost policy's candidate loop in C (router.policy).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__select(void)
{
    PyObject *ready = PyImport_ImportModule("kvshare._native._ready");
    if (!ready)
        return NULL;
    ReadyType = (PyTypeObject *)PyObject_GetAttrString(ready, "Book");
    Py_DECREF(ready);
    if (!ReadyType)
        return NULL;
    return PyModule_Create(&module);
}
