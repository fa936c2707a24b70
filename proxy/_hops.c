/*
 * proxy._hops: the compiled twin of proxy/metrics.py's `pure_record_hops`.
 *
 *   record_hops(hops, sums, call)
 *
 * Reads a finished call's hop timestamps (proxy.calls: Call and its Attempts; 0 = did not
 * happen) and adds one sample per hop that has both ends in order: `hops[hop]` is that
 * hop's list of bucket counts (non-cumulative, one more than the bounds: +Inf), `sums[hop]`
 * its sum of durations in ns. The rules are the pure function's, line for line
 * (tests/test_metrics.py checks the twins agree on any timestamps).
 *
 * `bind(bounds_ns, read_request, acquire, write_upstream, service_time, read_response,
 * backoff, queued, write_response)` must be called once (by proxy.metrics): the bucket
 * bounds and each hop's index.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_BOUNDS 64
enum { H_READ_REQUEST, H_ACQUIRE, H_WRITE_UPSTREAM, H_SERVICE_TIME, H_READ_RESPONSE, H_BACKOFF,
       H_QUEUED, H_WRITE_RESPONSE, N_HOPS };

static long long BOUNDS[MAX_BOUNDS];
static Py_ssize_t NBOUNDS = -1;      /* -1: bind() not called */
static Py_ssize_t HOP[N_HOPS];       /* each hop's index into hops and sums */
static Py_ssize_t MAX_HOP;

static PyObject *S_t_start, *S_t_framed, *S_attempts, *S_t_acquire, *S_t_acquired, *S_t_written,
    *S_t_first_reply, *S_t_reply, *S_backoffs, *S_t_done, *S_t_write, *S_t_acked, *S_t_handed;

/* obj.name as a C integer; -1 with an exception set on failure. */
static inline int
get_ns(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    long long x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

/* list[i] += by (list items are Python ints). */
static inline int
bump(PyObject *list, Py_ssize_t i, long long by)
{
    PyObject *old = PyList_GET_ITEM(list, i);
    long long v = PyLong_AsLongLong(old);
    if (v == -1 && PyErr_Occurred())
        return -1;
    PyObject *nv = PyLong_FromLongLong(v + by);
    if (nv == NULL)
        return -1;
    PyList_SET_ITEM(list, i, nv);
    Py_DECREF(old);
    return 0;
}

/* One sample of duration d for hop h: bisect_left on the bounds, as the pure one does. */
static inline int
sample(PyObject *hops, PyObject *sums, int h, long long d)
{
    Py_ssize_t lo = 0, hi = NBOUNDS;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (BOUNDS[mid] < d)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (bump(PyList_GET_ITEM(hops, HOP[h]), lo, 1) < 0)
        return -1;
    return bump(sums, HOP[h], d);
}

#define GET(obj, name, var) if (get_ns(obj, S_##name, &var) < 0) goto fail
#define SAMPLE(h, d) if (sample(hops, sums, h, d) < 0) goto fail

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
    PyObject *hops = args[0], *sums = args[1], *call = args[2];
    if (!PyList_CheckExact(hops) || !PyList_CheckExact(sums) || PyList_GET_SIZE(hops) <= MAX_HOP
            || PyList_GET_SIZE(sums) <= MAX_HOP) {
        PyErr_SetString(PyExc_TypeError, "record_hops: hops and sums must be lists with a place for every hop");
        return NULL;
    }
    for (int h = 0; h < N_HOPS; h++) {
        PyObject *row = PyList_GET_ITEM(hops, HOP[h]);
        if (!PyList_CheckExact(row) || PyList_GET_SIZE(row) != NBOUNDS + 1) {
            PyErr_SetString(PyExc_TypeError, "record_hops: every hop's buckets must be a list of len(bounds) + 1");
            return NULL;
        }
    }
    PyObject *attempts = NULL, *backoffs = NULL;
    long long t0, t1, t2;

    GET(call, t_start, t0);
    GET(call, t_framed, t1);
    if (t0 && t1 >= t0)
        SAMPLE(H_READ_REQUEST, t1 - t0);

    attempts = PyObject_GetAttr(call, S_attempts);
    if (attempts == NULL)
        goto fail;
    if (!PyList_CheckExact(attempts)) {
        PyErr_SetString(PyExc_TypeError, "record_hops: call.attempts must be a list");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(attempts); i++) {
        PyObject *a = PyList_GET_ITEM(attempts, i);
        GET(a, t_acquire, t0);
        GET(a, t_acquired, t1);
        if (!(t0 && t1 >= t0))
            continue;
        SAMPLE(H_ACQUIRE, t1 - t0);
        GET(a, t_written, t0);
        if (!(t0 >= t1))
            continue;
        SAMPLE(H_WRITE_UPSTREAM, t0 - t1);
        GET(a, t_first_reply, t2);
        GET(a, t_reply, t1);
        long long first = t2 ? t2 : t1;   /* t_first_reply or t_reply */
        if (!(first >= t0))
            continue;
        SAMPLE(H_SERVICE_TIME, first - t0);
        if (t2 && t1 >= t2)
            SAMPLE(H_READ_RESPONSE, t1 - t2);
    }
    Py_CLEAR(attempts);

    backoffs = PyObject_GetAttr(call, S_backoffs);
    if (backoffs == NULL)
        goto fail;
    if (!PyList_CheckExact(backoffs)) {
        PyErr_SetString(PyExc_TypeError, "record_hops: call.backoffs must be a list");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(backoffs); i++) {
        PyObject *pair = PyList_GET_ITEM(backoffs, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "record_hops: call.backoffs must hold (start, end) pairs");
            goto fail;
        }
        t0 = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 0));
        if (t0 == -1 && PyErr_Occurred())
            goto fail;
        t1 = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 1));
        if (t1 == -1 && PyErr_Occurred())
            goto fail;
        if (t0 && t1 >= t0)
            SAMPLE(H_BACKOFF, t1 - t0);
    }
    Py_CLEAR(backoffs);

    GET(call, t_done, t0);
    GET(call, t_write, t1);
    if (t0 && t1 >= t0) {
        SAMPLE(H_QUEUED, t1 - t0);
        t0 = t1;
    }
    GET(call, t_acked, t1);
    if (!t1)
        GET(call, t_handed, t1);
    if (t0 && t1 >= t0)  /* from t_write (else t_done, if the listener does not stamp t_write) */
        SAMPLE(H_WRITE_RESPONSE, t1 - t0);
    Py_RETURN_NONE;

fail:
    Py_XDECREF(attempts);
    Py_XDECREF(backoffs);
    return NULL;
}

static PyObject *
bind(PyObject *module, PyObject *args)
{
    PyObject *bounds;
    Py_ssize_t hop[N_HOPS];
    if (!PyArg_ParseTuple(args, "O!nnnnnnnn:bind", &PyTuple_Type, &bounds, &hop[0], &hop[1], &hop[2],
                          &hop[3], &hop[4], &hop[5], &hop[6], &hop[7]))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(bounds);
    if (n > MAX_BOUNDS) {
        PyErr_Format(PyExc_ValueError, "bind: at most %d bounds", MAX_BOUNDS);
        return NULL;
    }
    long long b[MAX_BOUNDS];
    for (Py_ssize_t i = 0; i < n; i++) {
        b[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(bounds, i));
        if (b[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    Py_ssize_t max_hop = 0;
    for (int h = 0; h < N_HOPS; h++) {
        if (hop[h] < 0) {
            PyErr_SetString(PyExc_ValueError, "bind: hop indexes must be >= 0");
            return NULL;
        }
        if (hop[h] > max_hop)
            max_hop = hop[h];
    }
    memcpy(BOUNDS, b, sizeof(long long) * (size_t)n);
    memcpy(HOP, hop, sizeof(hop));
    MAX_HOP = max_hop;
    NBOUNDS = n;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"record_hops", (PyCFunction)(void (*)(void))record_hops, METH_FASTCALL,
     "record_hops(hops, sums, call)\n\nOne sample per hop of a finished call (see proxy.metrics)."},
    {"bind", bind, METH_VARARGS,
     "bind(bounds_ns, read_request, acquire, write_upstream, service_time, read_response, backoff, "
     "queued, write_response)"},
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
    return PyModule_Create(&hops_module);
}
