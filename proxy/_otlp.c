/*
 * proxy._otlp: the compiled twin of proxy/otlp.py's `Encoder.span`, for a whole call at once.
 *
 *   encode_spans(trace, plan) -> bytes | None
 *
 * `trace` is `otlp.trace_prefix(...)` (bytes); `plan` the list of span tuples that
 * `proxy.telemetry.Telemetry.plan` returns: (name, span_id, parent_id, remote, kind, t0, t1,
 * attrs, error). The result is the spans' `ScopeSpans.spans` fields joined, byte for byte what
 * `b"".join(encoder.span(trace, *span) for span in plan)` writes (tests/test_otlp_compiled.py
 * checks the twins agree on fuzzed plans).
 *
 * It returns None, having written nothing anyone sees, for anything it does not handle exactly
 * as the Python encoder would: a tuple of another shape, a name or key that is not a str, an id
 * or time that is not an int in 0..2**64-1, a kind over 255, a `remote` that is not a bool,
 * attributes that are not a dict or None, an error that is neither None nor a str, a string
 * that cannot be UTF-8 encoded, and attribute values that are not exactly str, bool, int or
 * float (sequences, mappings, bytes, None, subclasses). The caller then runs the
 * Python encoder, which writes, skips or raises as it always did.
 *
 * Why: writing a call's ~8 spans in Python costs ~25 µs of the export thread (which holds the
 * GIL, so the event loop waits that long); here it is ~1-2 µs.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    char *p;
    Py_ssize_t len;
    Py_ssize_t cap;
} Buf;

static int
buf_reserve(Buf *b, Py_ssize_t more)
{
    if (b->len + more <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap ? b->cap : 1024;
    while (cap < b->len + more) {
        if (cap > PY_SSIZE_T_MAX / 2)
            return -1;
        cap *= 2;
    }
    char *p = PyMem_Realloc(b->p, (size_t)cap);
    if (p == NULL)
        return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

static int
put(Buf *b, const void *data, Py_ssize_t n)
{
    if (buf_reserve(b, n) < 0)
        return -1;
    memcpy(b->p + b->len, data, (size_t)n);
    b->len += n;
    return 0;
}

static int
put_byte(Buf *b, unsigned char c)
{
    if (buf_reserve(b, 1) < 0)
        return -1;
    b->p[b->len++] = (char)c;
    return 0;
}

static int
varint_len(uint64_t v)
{
    int n = 1;
    while (v > 0x7F) {
        v >>= 7;
        n++;
    }
    return n;
}

static int
put_varint(Buf *b, uint64_t v)
{
    if (buf_reserve(b, 10) < 0)
        return -1;
    while (v > 0x7F) {
        b->p[b->len++] = (char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    b->p[b->len++] = (char)v;
    return 0;
}

static int
put_be64(Buf *b, uint64_t v)
{
    unsigned char out[8];
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)(v & 0xFF);
        v >>= 8;
    }
    return put(b, out, 8);
}

static int
put_le64(Buf *b, uint64_t v)
{
    unsigned char out[8];
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)(v & 0xFF);
        v >>= 8;
    }
    return put(b, out, 8);
}

/* tag, varint length, bytes: a length-delimited field */
static int
put_field(Buf *b, unsigned char tag, const char *data, Py_ssize_t n)
{
    if (put_byte(b, tag) < 0 || put_varint(b, (uint64_t)n) < 0)
        return -1;
    return put(b, data, n);
}

/* An exact int in 0..2**64-1, else -1 with no exception set (the caller falls back).
 * (Not PyLong_AsUnsignedLongLong: in 3.11 it goes through _PyLong_AsByteArray, ~5x slower.) */
static int
as_u64(PyObject *o, uint64_t *out)
{
    if (!PyLong_CheckExact(o))
        return -1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
        if (v < 0)
            return -1;
        *out = (uint64_t)v;
        return 0;
    }
    if (overflow < 0)
        return -1;
    size_t bits = _PyLong_NumBits(o);  /* >= 64 here; (size_t)-1 if it cannot say */
    if (bits == (size_t)-1 || bits > 64) {
        PyErr_Clear();
        return -1;
    }
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(o);
    return 0;
}

/* UTF-8 of an exact str, else NULL with no exception set. */
static const char *
utf8(PyObject *o, Py_ssize_t *n)
{
    if (!PyUnicode_CheckExact(o))
        return NULL;
    const char *s = PyUnicode_AsUTF8AndSize(o, n);
    if (s == NULL)
        PyErr_Clear();
    return s;
}

#define FALLBACK 1   /* not ours to write: the Python encoder does the whole call */
#define FAILED (-1)  /* out of memory: an exception is set */

/* One Span.attributes (9) entry: KeyValue{key (1), value (2): AnyValue{...}} */
static int
put_attribute(Buf *b, PyObject *key, PyObject *value)
{
    Py_ssize_t klen, vlen = 0;
    const char *k = utf8(key, &klen);
    if (k == NULL)
        return FALLBACK;
    /* the AnyValue body: its one field */
    unsigned char head[10];
    int hlen = 0;
    const char *vbytes = NULL;
    uint64_t ival = 0;
    double dval = 0.0;
    Py_ssize_t any_len;
    PyTypeObject *t = Py_TYPE(value);
    if (t == &PyUnicode_Type) {
        vbytes = utf8(value, &vlen);
        if (vbytes == NULL)
            return FALLBACK;
        any_len = 1 + varint_len((uint64_t)vlen) + vlen;          /* string_value (1) */
    }
    else if (t == &PyBool_Type) {
        head[0] = 0x10;                                             /* bool_value (2) */
        head[1] = value == Py_True ? 1 : 0;
        hlen = 2;
        any_len = 2;
    }
    else if (t == &PyLong_Type) {
        ival = (uint64_t)PyLong_AsUnsignedLongLongMask(value);     /* n & 0xFFFF_FFFF_FFFF_FFFF */
        if (ival == (uint64_t)-1 && PyErr_Occurred())
            return FAILED;
        any_len = 1 + varint_len(ival);                             /* int_value (3) */
    }
    else if (t == &PyFloat_Type) {
        dval = PyFloat_AS_DOUBLE(value);                            /* double_value (4) */
        any_len = 9;
    }
    else
        return FALLBACK;
    Py_ssize_t key_field = 1 + varint_len((uint64_t)klen) + klen;
    Py_ssize_t value_field = 1 + varint_len((uint64_t)any_len) + any_len;
    Py_ssize_t kv_len = key_field + value_field;
    if (put_byte(b, 0x4A) < 0 || put_varint(b, (uint64_t)kv_len) < 0 || put_field(b, 0x0A, k, klen) < 0
            || put_byte(b, 0x12) < 0 || put_varint(b, (uint64_t)any_len) < 0)
        return FAILED;
    if (t == &PyUnicode_Type)
        return put_field(b, 0x0A, vbytes, vlen) < 0 ? FAILED : 0;
    if (t == &PyBool_Type)
        return put(b, head, hlen) < 0 ? FAILED : 0;
    if (t == &PyLong_Type)
        return (put_byte(b, 0x18) < 0 || put_varint(b, ival) < 0) ? FAILED : 0;
    uint64_t bits;
    memcpy(&bits, &dval, 8);
    return (put_byte(b, 0x21) < 0 || put_le64(b, bits) < 0) ? FAILED : 0;
}

/* SpanFlags: CONTEXT_HAS_IS_REMOTE (0x100), | CONTEXT_IS_REMOTE (0x200) */
static int
put_flags(Buf *b, int remote)
{
    unsigned char f[6] = {0x85, 0x01, 0x00, remote ? 0x03 : 0x01, 0x00, 0x00};
    return put(b, f, 6);
}

/* One span as a ScopeSpans.spans (2) field, appended to `b`. */
static int
put_span(Buf *b, const char *trace, Py_ssize_t trace_len, PyObject *span)
{
    if (!PyTuple_CheckExact(span) || PyTuple_GET_SIZE(span) != 9)
        return FALLBACK;
    PyObject *name = PyTuple_GET_ITEM(span, 0);
    PyObject *attrs = PyTuple_GET_ITEM(span, 7);
    PyObject *error = PyTuple_GET_ITEM(span, 8);
    uint64_t span_id, parent_id, kind, t0, t1;
    if (as_u64(PyTuple_GET_ITEM(span, 1), &span_id) < 0 || as_u64(PyTuple_GET_ITEM(span, 2), &parent_id) < 0
            || as_u64(PyTuple_GET_ITEM(span, 4), &kind) < 0 || kind > 0xFF
            || as_u64(PyTuple_GET_ITEM(span, 5), &t0) < 0 || as_u64(PyTuple_GET_ITEM(span, 6), &t1) < 0)
        return FALLBACK;
    PyObject *remote_o = PyTuple_GET_ITEM(span, 3);
    if (remote_o != Py_True && remote_o != Py_False)
        return FALLBACK;
    int remote = remote_o == Py_True;
    Py_ssize_t name_len;
    const char *name_s = utf8(name, &name_len);
    if (name_s == NULL)
        return FALLBACK;
    const char *err_s = NULL;
    Py_ssize_t err_len = 0;
    if (error != Py_None && (err_s = utf8(error, &err_len)) == NULL)
        return FALLBACK;
    if (attrs != Py_None && !PyDict_CheckExact(attrs))
        return FALLBACK;

    /* the body goes after room for the longest length prefix; moved back once its length is known */
    Py_ssize_t start = b->len;
    if (buf_reserve(b, 11) < 0)
        return FAILED;
    b->len += 11;
    Py_ssize_t body = b->len;
    if (put(b, trace, trace_len) < 0
            || put_byte(b, 0x12) < 0 || put_byte(b, 8) < 0 || put_be64(b, span_id) < 0)
        return FAILED;
    if (parent_id && (put_byte(b, 0x22) < 0 || put_byte(b, 8) < 0 || put_be64(b, parent_id) < 0))
        return FAILED;
    if (put_field(b, 0x2A, name_s, name_len) < 0
            || put_byte(b, 0x30) < 0 || put_byte(b, (unsigned char)kind) < 0
            || put_byte(b, 0x39) < 0 || put_le64(b, t0) < 0
            || put_byte(b, 0x41) < 0 || put_le64(b, t1) < 0)
        return FAILED;
    if (attrs != Py_None && PyDict_GET_SIZE(attrs)) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(attrs, &pos, &k, &v)) {
            int r = put_attribute(b, k, v);
            if (r != 0)
                return r;
        }
    }
    if (err_s == NULL) {
        if (put_byte(b, 0x7A) < 0 || put_byte(b, 0) < 0)    /* status (15): present, empty */
            return FAILED;
    }
    else {
        /* Status{message (2), code (3): ERROR} */
        Py_ssize_t status_len = (err_len ? 1 + varint_len((uint64_t)err_len) + err_len : 0) + 2;
        if (put_byte(b, 0x7A) < 0 || put_varint(b, (uint64_t)status_len) < 0)
            return FAILED;
        if (err_len && put_field(b, 0x12, err_s, err_len) < 0)
            return FAILED;
        if (put_byte(b, 0x18) < 0 || put_byte(b, 0x02) < 0)
            return FAILED;
    }
    if (put_flags(b, remote) < 0)
        return FAILED;

    /* the ScopeSpans.spans (2) head, then the body moved up against it */
    Py_ssize_t n = b->len - body;
    unsigned char head[11];
    int h = 0;
    uint64_t v = (uint64_t)n;
    head[h++] = 0x12;
    while (v > 0x7F) {
        head[h++] = (unsigned char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    head[h++] = (unsigned char)v;
    memcpy(b->p + start, head, (size_t)h);
    memmove(b->p + start + h, b->p + body, (size_t)n);
    b->len = start + h + n;
    return 0;
}

static PyObject *
encode_spans(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "encode_spans(trace, plan) takes 2 arguments");
        return NULL;
    }
    PyObject *trace = args[0], *plan = args[1];
    if (!PyBytes_CheckExact(trace) || !PyList_CheckExact(plan))
        Py_RETURN_NONE;
    Buf b = {NULL, 0, 0};
    int r = 0;
    /* (nothing here runs Python code: the list and its tuples cannot change under us) */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(plan) && r == 0; i++)
        r = put_span(&b, PyBytes_AS_STRING(trace), PyBytes_GET_SIZE(trace), PyList_GET_ITEM(plan, i));
    PyObject *out;
    if (r == FAILED)
        out = PyErr_Occurred() ? NULL : PyErr_NoMemory();
    else if (r == FALLBACK)
        out = Py_NewRef(Py_None);
    else
        out = PyBytes_FromStringAndSize(b.p ? b.p : "", b.len);
    PyMem_Free(b.p);
    return out;
}

static PyMethodDef methods[] = {
    {"encode_spans", (PyCFunction)(void (*)(void))encode_spans, METH_FASTCALL,
     "encode_spans(trace, plan) -> bytes | None: the plan's spans as ScopeSpans.spans fields "
     "(None: let the Python encoder write them)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "proxy._otlp",
    "The compiled twin of proxy.otlp.Encoder.span over a whole span plan.", -1, methods,
};

PyMODINIT_FUNC
PyInit__otlp(void)
{
    return PyModule_Create(&module);
}
