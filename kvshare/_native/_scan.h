/* _scan.h: the cut-point scan of kvshare.cost.CostModel.plan_runs over C arrays, shared by
 * kvshare._plan (the scan alone) and kvshare._select (the cost policy's selection).
 *
 * The same loop as kvshare.cost._scan_py, operation for operation in IEEE doubles (every user is
 * built with -ffp-contract=off: no fused multiply-add), so it gives the very same floats.
 * Callers check the plain case first: 0 < bt, p <= 2**30; sources within fetch; run lengths
 * and sources |v| <= 2**40.
 */
#ifndef KVSHARE_SCAN_H
#define KVSHARE_SCAN_H

#include <math.h>

#define SCAN_FLAT 1e-12 /* kvshare.cost._FLAT */

/* Argument checks for the scan's callers (include Python.h first). The scan computes exactly as
 * Python only on exact floats and on ints with |v| <= 2**40 (every product below stays exact
 * in a double and in Python's ints); anything else raises, naming the caller (``who``), and the
 * caller's Python path takes over. ``exact_int``: refuse int subclasses (bool) too. */
static int scan_float(PyObject *o, double *out, const char *who)
{
    if (!PyFloat_CheckExact(o)) {
        PyErr_Format(PyExc_TypeError, "%s needs exact floats", who);
        return -1;
    }
    *out = PyFloat_AS_DOUBLE(o);
    return 0;
}

static int scan_int(PyObject *o, long long *out, const char *who, int exact_int)
{
    if (exact_int ? !PyLong_CheckExact(o) : !PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s needs ints", who);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v > (1LL << 40) || v < -(1LL << 40)) {
        PyErr_Format(PyExc_ValueError, "%s needs small ints", who);
        return -1;
    }
    *out = v;
    return 0;
}

typedef struct {
    long long k;  /* the best cut, in blocks */
    double total; /* its total seconds (fetch + latency + prefill of the rest) */
    double fetch; /* its fetch seconds (with the latency) */
} ScanResult;

/* ``src[r]``, ``len[r]``: the runs (source, count) in block order; ``max_fetch``: Python's
 * max(fetch) (the first of equals). */
static ScanResult scan_runs(const double *fetch, double max_fetch, double a, double b,
                            long long bt, long long p, double lat_r, double lat_l,
                            const long long *src, const long long *len, long long n_runs)
{
    long long last = p - 1;
    ScanResult best = {0, a * (double)p + b * (double)p * (double)p / 2.0, 0.0};
    double cum = 0.0, lat = 0.0;
    int any_r = 0, any_l = 0;
    long long i = 0;
    double flat = SCAN_FLAT * (best.total + lat_r + lat_l + max_fetch * (double)(p / bt + 1));
    int curved = b * (double)bt * (double)bt > flat;
    for (long long r = 0; r < n_runs; r++) {
        double f = fetch[src[r]];
        if (src[r] >= 3) {
            if (!any_r) {
                any_r = 1;
                lat = lat + lat_r;
            }
        } else if (src[r] && !any_l) {
            any_l = 1;
            lat = lat + lat_l;
        }
        long long first = i + 1, end = first + len[r] - 1;
        int ends_only = curved || fabs(f - a * (double)bt) > flat;
        for (long long k = first; k <= end; k++) {
            i = k;
            cum += f;
            if (ends_only && first < k && k < end && (k + 1) * bt <= last)
                continue;
            long long c = k * bt;
            if (c > last)
                c = last;
            long long n = p - c;
            double total = cum + lat + a * (double)n + b * (double)n * ((double)c + (double)n / 2.0);
            if (total <= best.total) {
                best.k = k;
                best.total = total;
                best.fetch = cum + lat;
            }
            if (c >= last)
                return best;
        }
    }
    return best;
}

#endif
