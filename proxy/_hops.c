/*
 * proxy._hops: the compiled twin of proxy/metrics.py's `pure_record_hops`.
 *
 *   record_hops(hops, sums, call)
 *
 * Reads a finished call's hop timestamps (proxy.calls: Call and its Attempts; 0 = did not
 * happen) and adds one sample per hop that has both ends in order: `hops[hop]` is that
 * hop's list of bucket counts (non-cumulative, one more than the bounds: +Inf), `sums[hop]`
 * its sum of durations in ns. The rules are the pure function's, line for line
 * (tests/test_metrics.py checks the twins agree).
 *
 * Two phases, so that nothing is half done: first every timestamp is read and every sample
 * worked out (reading attributes may run Python code; what is read is held by a reference of
 * our own), then the target lists are checked and every new count computed, and only then
 * written (no Python code runs while writing). Anything this fast path does not handle
 * exactly as the pure function would (a timestamp or count that is not a plain int or does
 * not fit in 64 bits, a duration or sum that would overflow, lists of another shape, more
 * than MAX_SAMPLES samples) goes to the pure function instead, before anything is written.
 *
 * `bind(bounds_ns, read_request, acquire, write_upstream, service_time, read_response,
 * backoff, queued, write_response, pure)` must be called once (by proxy.metrics): the bucket
 * bounds, each hop's index, and the pure function.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>

#define MAX_BOUNDS 64
#define MAX_SAMPLES 64
enum { H_READ_REQUEST, H_ACQUIRE, H_WRITE_UPSTREAM, H_SERVICE_TIME, H_READ_RESPONSE, H_BACKOFF,
       H_QUEUED, H_WRITE_RESPONSE, N_HOPS };

static long long BOUNDS[MAX_BOUNDS];
static Py_ssize_t NBOUNDS = -1;      /* -1: bind() not called */
static Py_ssize_t HOP[N_HOPS];       /* each hop's index into hops and sums */
static PyObject *PURE;               /* proxy.metrics.pure_record_hops */

static PyObject *S_t_start, *S_t_framed, *S_t_admitted, *S_attempts, *S_t_acquire, *S_t_acquired, *S_t_written,
    *S_t_first_reply, *S_t_reply, *S_backoffs, *S_t_done, *S_t_write, *S_t_acked, *S_t_handed, *S_waited, *S_held_ns;

enum { OK = 0, ERROR = -1, PURE_PATH = 1 };

typedef struct {
    int hop;
    long long d;
} Sample;

typedef struct {
    Sample s[MAX_SAMPLES];
    int n;
} Samples;

/* A plain int that fits in 64 bits; PURE_PATH for anything else. */
static inline int
as_ns(PyObject *v, long long *out)
{
    if (!PyLong_CheckExact(v))
        return PURE_PATH;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow)
        return PURE_PATH;
    if (x == -1 && PyErr_Occurred())
        return ERROR;
    *out = x;
    return OK;
}

static inline int
get_ns(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return ERROR;
    int r = as_ns(v, out);
    Py_DECREF(v);
    return r;
}

/* Adds the sample t1 - t0 of hop h (the caller checked t1 >= t0). */
static inline int
add(Samples *out, int h, long long t0, long long t1)
{
    long long d;
    if (__builtin_sub_overflow(t1, t0, &d) || out->n == MAX_SAMPLES)
        return PURE_PATH;
    out->s[out->n].hop = h;
    out->s[out->n].d = d;
    out->n++;
    return OK;
}

/* A plain bool (True or False); PURE_PATH for anything else (its truth may run Python code). */
static inline int
get_bool(PyObject *obj, PyObject *name, int *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return ERROR;
    int r = OK;
    if (v == Py_True)
        *out = 1;
    else if (v == Py_False)
        *out = 0;
    else
        r = PURE_PATH;
    Py_DECREF(v);
    return r;
}

#define TRY(expr) do { int r_ = (expr); if (r_ != OK) { rc = r_; goto done; } } while (0)

/* Phase 1: the call's samples, as the pure function would take them. */
static int
read_samples(PyObject *call, Samples *out)
{
    int rc = OK;
    PyObject *attempts = NULL, *backoffs = NULL, *item = NULL;
    long long t0, t1, t2, first, held;
    int waited;

    TRY(get_ns(call, S_t_start, &t0));
    if (t0) {
        TRY(get_ns(call, S_t_framed, &t1));
        if (t1 >= t0)
            TRY(add(out, H_READ_REQUEST, t0, t1));
        TRY(get_ns(call, S_t_admitted, &t2));  /* held back at max_inflight: queued */
        if (t2 && t1 && t2 > t1)
            TRY(add(out, H_QUEUED, t1, t2));
    } else {  /* `t0 and ...`: t_framed is not looked at (it may be anything) */
        PyObject *v = PyObject_GetAttr(call, S_t_framed);
        if (v == NULL)
            TRY(ERROR);
        Py_DECREF(v);
    }

    attempts = PyObject_GetAttr(call, S_attempts);
    if (attempts == NULL)
        TRY(ERROR);
    if (!PyList_CheckExact(attempts))
        TRY(PURE_PATH);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(attempts); i++) {  /* the size may change: re-read */
        item = PyList_GET_ITEM(attempts, i);
        Py_INCREF(item);
        TRY(get_ns(item, S_t_acquire, &t0));
        if (t0) {
            TRY(get_ns(item, S_t_acquired, &t1));
            if (!t1) {  /* never got a connection: it waited until the attempt ended */
                TRY(get_ns(item, S_t_reply, &t1));
                if (!t1)
                    TRY(get_ns(call, S_t_done, &t1));  /* t_reply or call.t_done */
                if (t1 >= t0)
                    TRY(add(out, H_ACQUIRE, t0, t1));
            } else if (t1 >= t0) {
                TRY(add(out, H_ACQUIRE, t0, t1));
                TRY(get_ns(item, S_t_written, &t0));
                if (t0 >= t1) {
                    TRY(add(out, H_WRITE_UPSTREAM, t1, t0));
                    TRY(get_ns(item, S_t_first_reply, &t2));
                    TRY(get_ns(item, S_t_reply, &t1));
                    first = t2 ? t2 : t1;   /* t_first_reply or t_reply */
                    if (first >= t0) {
                        TRY(add(out, H_SERVICE_TIME, t0, first));
                        if (t2 && t1 >= t2) {
                            TRY(get_ns(item, S_held_ns, &held));
                            if (held > 0) {  /* held unread for its turn: that wait is queued */
                                if (__builtin_add_overflow(t2, held, &first))
                                    TRY(PURE_PATH);
                                if (first > t1)
                                    first = t1;
                                TRY(add(out, H_QUEUED, t2, first));
                                t2 = first;
                            }
                            TRY(add(out, H_READ_RESPONSE, t2, t1));
                        }
                    }
                }
            }
        } else {
            TRY(PURE_PATH);  /* rare (an attempt never started): the pure rules, exactly */
        }
        Py_CLEAR(item);
    }
    Py_CLEAR(attempts);

    backoffs = PyObject_GetAttr(call, S_backoffs);
    if (backoffs == NULL)
        TRY(ERROR);
    if (!PyList_CheckExact(backoffs))
        TRY(PURE_PATH);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(backoffs); i++) {
        item = PyList_GET_ITEM(backoffs, i);
        Py_INCREF(item);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2)
            TRY(PURE_PATH);
        TRY(as_ns(PyTuple_GET_ITEM(item, 0), &t0));
        TRY(as_ns(PyTuple_GET_ITEM(item, 1), &t1));
        if (t0 && t1 >= t0)
            TRY(add(out, H_BACKOFF, t0, t1));
        Py_CLEAR(item);
    }
    Py_CLEAR(backoffs);

    TRY(get_ns(call, S_t_done, &t0));
    TRY(get_ns(call, S_t_write, &t1));
    TRY(get_bool(call, S_waited, &waited));
    if (waited && t0 && t1 > t0)  /* as the span: only a reply that waited behind an earlier one */
        TRY(add(out, H_QUEUED, t0, t1));
    if (t1)  /* from t_write (a streamed reply's is before t_done), else t_done */
        t0 = t1;
    TRY(get_ns(call, S_t_acked, &t1));
    if (!t1)
        TRY(get_ns(call, S_t_handed, &t1));
    if (t0 && t1 >= t0)
        TRY(add(out, H_WRITE_RESPONSE, t0, t1));

done:
    Py_XDECREF(item);
    Py_XDECREF(attempts);
    Py_XDECREF(backoffs);
    return rc;
}

static inline Py_ssize_t
bucket(long long d)
{
    Py_ssize_t lo = 0, hi = NBOUNDS;  /* bisect_left, as the pure one does */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (BOUNDS[mid] < d)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* list[i] + by, if list[i] is a plain int and the sum fits in 64 bits. */
static inline int
plus(PyObject *list, Py_ssize_t i, long long by, long long *out)
{
    long long v;
    int r = as_ns(PyList_GET_ITEM(list, i), &v);
    if (r != OK)
        return r;
    if (__builtin_add_overflow(v, by, out))
        return PURE_PATH;
    return OK;
}

static inline void
put(PyObject *list, Py_ssize_t i, PyObject *value)
{
    PyObject *old = PyList_GET_ITEM(list, i);
    PyList_SET_ITEM(list, i, value);
    Py_DECREF(old);
}

/* Phase 2: check every target, compute every new value, then write them all. */
static int
write_samples(PyObject *hops, PyObject *sums, const Samples *in)
{
    if (!PyList_CheckExact(hops) || !PyList_CheckExact(sums))
        return PURE_PATH;
    PyObject *rows[MAX_SAMPLES];
    Py_ssize_t idx[MAX_SAMPLES];
    long long count[MAX_SAMPLES], total[MAX_SAMPLES];
    PyObject *newc[MAX_SAMPLES], *news[MAX_SAMPLES];
    for (int k = 0; k < in->n; k++) {
        Py_ssize_t h = HOP[in->s[k].hop];
        if (h >= PyList_GET_SIZE(hops) || h >= PyList_GET_SIZE(sums))
            return PURE_PATH;
        PyObject *row = PyList_GET_ITEM(hops, h);
        if (!PyList_CheckExact(row) || PyList_GET_SIZE(row) != NBOUNDS + 1)
            return PURE_PATH;
        rows[k] = row;
        idx[k] = bucket(in->s[k].d);
        /* an earlier sample of the same hop (retries) counts first */
        long long extra_c = 0, extra_s = 0;
        for (int j = 0; j < k; j++) {
            if (in->s[j].hop == in->s[k].hop) {
                extra_s += in->s[j].d;  /* no overflow: each sum was checked below */
                if (idx[j] == idx[k])
                    extra_c++;
            }
        }
        int r = plus(row, idx[k], 1 + extra_c, &count[k]);
        if (r != OK)
            return r;
        long long by;
        if (__builtin_add_overflow(in->s[k].d, extra_s, &by))
            return PURE_PATH;
        r = plus(sums, h, by, &total[k]);
        if (r != OK)
            return r;
    }
    for (int k = 0; k < in->n; k++) {  /* allocations only: no Python code, no GC, runs here */
        newc[k] = PyLong_FromLongLong(count[k]);
        news[k] = PyLong_FromLongLong(total[k]);
        if (newc[k] == NULL || news[k] == NULL) {
            for (int j = 0; j <= k; j++) {
                Py_XDECREF(newc[j]);
                Py_XDECREF(news[j]);
            }
            return ERROR;
        }
    }
    for (int k = 0; k < in->n; k++) {  /* in order: the last value of a place is its total */
        put(rows[k], idx[k], newc[k]);
        put(sums, HOP[in->s[k].hop], news[k]);
    }
    return OK;
}

static PyObject *
record_hops(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "record_hops() takes exactly 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (NBOUNDS < 0) {
        PyErr_SetString(PyExc_RuntimeError, "record_hops: bind() was not called");
        return NULL;
    }
    Samples samples;
    samples.n = 0;
    int r = read_samples(args[2], &samples);
    if (r == OK)
        r = write_samples(args[0], args[1], &samples);
    if (r == ERROR)
        return NULL;
    if (r == PURE_PATH)
        return PyObject_Vectorcall(PURE, args, 3, NULL);
    Py_RETURN_NONE;
}

static PyObject *
bind(PyObject *module, PyObject *args)
{
    PyObject *bounds, *pure;
    Py_ssize_t hop[N_HOPS];
    if (!PyArg_ParseTuple(args, "O!nnnnnnnnO:bind", &PyTuple_Type, &bounds, &hop[0], &hop[1], &hop[2],
                          &hop[3], &hop[4], &hop[5], &hop[6], &hop[7], &pure))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(bounds);
    if (n > MAX_BOUNDS) {
        PyErr_Format(PyExc_ValueError, "bind: at most %d bounds", MAX_BOUNDS);
        return NULL;
    }
    if (!PyCallable_Check(pure)) {
        PyErr_SetString(PyExc_TypeError, "bind: the pure function must be callable");
        return NULL;
    }
    long long b[MAX_BOUNDS];
    for (Py_ssize_t i = 0; i < n; i++) {
        b[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(bounds, i));
        if (b[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    for (int h = 0; h < N_HOPS; h++) {
        if (hop[h] < 0) {
            PyErr_SetString(PyExc_ValueError, "bind: hop indexes must be >= 0");
            return NULL;
        }
    }
    memcpy(BOUNDS, b, sizeof(long long) * (size_t)n);
    memcpy(HOP, hop, sizeof(hop));
    Py_INCREF(pure);
    Py_XSETREF(PURE, pure);
    NBOUNDS = n;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"record_hops", (PyCFunction)(void (*)(void))record_hops, METH_FASTCALL,
     "record_hops(hops, sums, call)\n\nOne sample per hop of a finished call (see proxy.metrics)."},
    {"bind", bind, METH_VARARGS,
     "bind(bounds_ns, read_request, acquire, write_upstream, service_time, read_response, backoff, "
     "queued, write_response, pure)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hops_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "proxy._hops",
    .m_doc = "Compiled hop histogram update of a finished call (the twin of proxy.metrics.pure_record_hops).",
    .m_size = -1,
    .m_methods = module_methods,
};

#define INTERN(name) if ((S_##name = PyUnicode_InternFromString(#name)) == NULL) return NULL

PyMODINIT_FUNC
PyInit__hops(void)
{
    INTERN(t_start);
    INTERN(t_framed);
    INTERN(t_admitted);
    INTERN(attempts);
    INTERN(t_acquire);
    INTERN(t_acquired);
    INTERN(t_written);
    INTERN(t_first_reply);
    INTERN(t_reply);
    INTERN(backoffs);
    INTERN(t_done);
    INTERN(t_write);
    INTERN(t_acked);
    INTERN(t_handed);
    INTERN(waited);
    INTERN(held_ns);
    return PyModule_Create(&hops_module);
}
