/*
 * proxy.codec._scan: the compiled twin of proxy/codec/scan.py's StructScanner.
 *
 * Finds where an unframed Thrift message's top-level struct ends, resumably:
 * when the bytes run out it keeps its place (a stack of frames, a pending
 * value type, a count of bytes still to skip) and the next advance() goes on
 * from there, so a long message fed in pieces is examined about once.
 *
 * The contract is the pure scanner's, step for step: after every advance()
 * the result (True / False / ProtocolError and its message), `pos`, `reach`,
 * `examined` and the internal state are the same as the pure scanner's after
 * the same calls (tests/test_scanner_compiled.py checks this on fuzzed input).
 * The fast paths below only take steps the pure scanner would take without
 * stopping or failing in between, so they never change what can be observed.
 *
 * Buffers: anything with the buffer protocol (bytes, bytearray, memoryview),
 * read in place, never copied. Needs 0 <= pos and end <= len(buf).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

enum { K_STRUCT = 0, K_LIST = 1, K_MAP = 2 };

#define DEFAULT_MAX_DEPTH 64
#define INLINE_FRAMES 16

typedef struct {
    int64_t n;          /* list: elements left; map: keys + values left */
    uint8_t kind;
    uint8_t a;          /* list: element type; map: key type */
    uint8_t b;          /* map: value type */
} Frame;

typedef struct {
    PyObject_HEAD
    Py_ssize_t pos;
    long long examined;
    int64_t skip;           /* bytes of the current value still to pass over */
    Py_ssize_t max_depth;
    Py_ssize_t depth;       /* frames on the stack; 0 once the struct is complete */
    Py_ssize_t cap;
    Frame *stack;
    int pending;            /* type of the next value to read, -1 = none */
    int compact;
    Frame inline_stack[INLINE_FRAMES];
} Scanner;

static PyObject *ProtocolError;   /* proxy.codec.errors.ProtocolError */

/* Binary protocol: sizes of fixed-size values (0 = not fixed) and valid types. */
static uint8_t BIN_FIXED[256];
static uint8_t BIN_VALID[256];
/* Compact protocol (4-bit types): fixed sizes (bools in containers are 1 byte), valid types. */
static const uint8_t CMP_FIXED[16] = {0, 1, 1, 1, 0, 0, 0, 8, 0, 0, 0, 0, 0, 16, 0, 0};
static const uint8_t CMP_VALID[16] = {0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0};

static void
init_tables(void)
{
    static const int valid[] = {2, 3, 4, 6, 8, 10, 11, 12, 13, 14, 15, 16};
    memset(BIN_FIXED, 0, sizeof BIN_FIXED);
    memset(BIN_VALID, 0, sizeof BIN_VALID);
    for (size_t i = 0; i < sizeof valid / sizeof valid[0]; i++)
        BIN_VALID[valid[i]] = 1;
    BIN_FIXED[2] = 1; BIN_FIXED[3] = 1; BIN_FIXED[4] = 8; BIN_FIXED[6] = 2;
    BIN_FIXED[8] = 4; BIN_FIXED[10] = 8; BIN_FIXED[16] = 16;
}

/* Raise ProtocolError(message): the class is called, as `raise ProtocolError(f"...")` does. */
static void
protocol_error(const char *format, ...)
{
    va_list vargs;
    va_start(vargs, format);
    PyObject *msg = PyUnicode_FromFormatV(format, vargs);
    va_end(vargs);
    if (msg == NULL)
        return;
    PyObject *exc = PyObject_CallOneArg(ProtocolError, msg);
    Py_DECREF(msg);
    if (exc == NULL)
        return;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
}

static inline int32_t
rd_i32(const uint8_t *p)
{
    return (int32_t)(((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3]);
}

static int
grow(Scanner *s);

static inline int
push(Scanner *s, int kind, int a, int b, int64_t n)
{
    if (s->depth >= s->max_depth) {
        protocol_error("bad request: nesting deeper than %zd", s->max_depth);
        return -1;
    }
    if (s->depth == s->cap && grow(s) < 0)
        return -1;
    Frame *f = &s->stack[s->depth++];
    f->kind = (uint8_t)kind;
    f->a = (uint8_t)a;
    f->b = (uint8_t)b;
    f->n = n;
    return 0;
}

/* The stack is full: twice the room (off the inline frames on the first time). */
static int
grow(Scanner *s)
{
    Py_ssize_t cap = s->cap * 2;
    Frame *stack;
    if (s->stack == s->inline_stack) {
        stack = PyMem_New(Frame, cap);
        if (stack != NULL)
            memcpy(stack, s->stack, sizeof(Frame) * (size_t)s->depth);
    } else {
        stack = s->stack;
        PyMem_Resize(stack, Frame, cap);
    }
    if (stack == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->stack = stack;
    s->cap = cap;
    return 0;
}

/* -- binary --------------------------------------------------------------- */

/* End of a fixed-size or string value of type t at pos if it is all here (and valid), else -1. */
static inline Py_ssize_t
bin_value_end(const uint8_t *buf, Py_ssize_t pos, Py_ssize_t end, int t)
{
    int size = BIN_FIXED[t];
    if (size)
        return end - pos >= size ? pos + size : -1;
    if (t == 11 && end - pos >= 4) {
        int32_t n = rd_i32(buf + pos);
        if (n >= 0 && end - pos - 4 >= n)
            return pos + 4 + n;
    }
    return -1;
}

/* End of a map at pos (its header first) whose keys and values are all fixed-size or
 * strings and all here, else -1 (then the map is read the long way, frame by frame, which
 * also reports what is wrong with it). The struct loop skips such a field in one step: the
 * pure scanner would push the map's frame, pass its entries and pop it, stopping nowhere. */
static inline Py_ssize_t
bin_map_end(const uint8_t *buf, Py_ssize_t pos, Py_ssize_t end)
{
    if (end - pos < 6)
        return -1;
    const int kt = buf[pos], vt = buf[pos + 1];
    int32_t n = rd_i32(buf + pos + 2);
    if (n < 0 || (n && (!BIN_VALID[kt] || !BIN_VALID[vt])))
        return -1;
    pos += 6;
    while (n > 0) {
        Py_ssize_t p = bin_value_end(buf, pos, end, kt);
        if (p < 0 || (p = bin_value_end(buf, p, end, vt)) < 0)
            return -1;
        pos = p;
        n--;
    }
    return pos;
}

/* 1 = struct complete, 0 = need more bytes, -1 = error raised. */
static int
scan_binary(Scanner *s, const uint8_t *buf, Py_ssize_t end)
{
    Py_ssize_t pos = s->pos;
    const Py_ssize_t start = pos;
    int pending = s->pending;
    int64_t skip = s->skip;
    int ret;

    for (;;) {
        if (skip) {
            Py_ssize_t avail = end - pos;
            if (avail < skip) {
                pos = end;
                skip -= avail;
                ret = 0;
                goto out;
            }
            pos += (Py_ssize_t)skip;
            skip = 0;
        }
        if (pending >= 0) {
            int t = pending;
            int size = BIN_FIXED[t];
            if (size) {
                skip = size;
                pending = -1;
                continue;
            }
            if (t == 11) {
                if (end - pos < 4) { ret = 0; goto out; }
                int32_t n = rd_i32(buf + pos);
                if (n < 0) {
                    protocol_error("bad request: negative string length %d", (int)n);
                    ret = -1; goto out;
                }
                pos += 4;
                skip = n;
            } else if (t == 12) {
                if (push(s, K_STRUCT, 0, 0, 0) < 0) { ret = -1; goto out; }
            } else if (t == 15 || t == 14) {
                if (end - pos < 5) { ret = 0; goto out; }
                int et = buf[pos];
                int32_t n = rd_i32(buf + pos + 1);
                if (!BIN_VALID[et]) {
                    protocol_error("bad request: invalid element type %d", et);
                    ret = -1; goto out;
                }
                if (n < 0) {
                    protocol_error("bad request: negative container size %d", (int)n);
                    ret = -1; goto out;
                }
                pos += 5;
                if (push(s, K_LIST, et, 0, n) < 0) { ret = -1; goto out; }
            } else {  /* 13 map */
                if (end - pos < 6) { ret = 0; goto out; }
                int kt = buf[pos];
                int vt = buf[pos + 1];
                int32_t n = rd_i32(buf + pos + 2);
                if (n < 0) {
                    protocol_error("bad request: negative container size %d", (int)n);
                    ret = -1; goto out;
                }
                if (n && (!BIN_VALID[kt] || !BIN_VALID[vt])) {
                    protocol_error("bad request: invalid map types %d/%d", kt, vt);
                    ret = -1; goto out;
                }
                pos += 6;
                if (push(s, K_MAP, kt, vt, 2 * (int64_t)n) < 0) { ret = -1; goto out; }
            }
            pending = -1;
            continue;
        }
        Frame *top = &s->stack[s->depth - 1];
        if (top->kind == K_STRUCT) {
            /* The struct's fields, one after another while each is a fixed-size or string
             * value all here (the fast path: no trip round the outer loop per field). */
            int t;
            for (;;) {
                if (pos >= end) { ret = 0; goto out; }
                t = buf[pos];
                if (t == 0)
                    break;
                if (end - pos < 3) { ret = 0; goto out; }
                if (!BIN_VALID[t]) {
                    protocol_error("bad request: invalid field type %d", t);
                    ret = -1; goto out;
                }
                Py_ssize_t p = bin_value_end(buf, pos + 3, end, t);
                if (p < 0) {
                    if (t != 13 || (p = bin_map_end(buf, pos + 3, end)) < 0 || s->depth >= s->max_depth)
                        break;
                }
                pos = p;
            }
            if (t == 0) {
                pos += 1;
                if (--s->depth == 0) { ret = 1; goto out; }
                continue;
            }
            pos += 3;
            if (t == 12) {  /* a struct field: its frame at once (what `pending` would do next) */
                if (push(s, K_STRUCT, 0, 0, 0) < 0) { pending = t; ret = -1; goto out; }
                continue;
            }
            pending = t;
        } else if (top->kind == K_LIST) {
            int64_t n = top->n;
            if (n == 0) {
                s->depth--;
                continue;
            }
            int et = top->a;
            int size = BIN_FIXED[et];
            if (size) {
                /* Fast path: every fixed-size element that is all here, at once. */
                int64_t k = (end - pos) / size;
                if (k > n)
                    k = n;
                if (k > 0) {
                    pos += (Py_ssize_t)(k * size);
                    top->n = n - k;
                    continue;
                }
            } else if (et == 11) {
                Py_ssize_t p;
                while (n > 0 && (p = bin_value_end(buf, pos, end, 11)) >= 0) {
                    pos = p;
                    n--;
                }
                if (n != top->n) {
                    top->n = n;
                    continue;
                }
            }
            top->n = n - 1;
            if (et == 12) {  /* a struct element: its frame at once (what `pending` would do next) */
                if (push(s, K_STRUCT, 0, 0, 0) < 0) { pending = et; ret = -1; goto out; }
                continue;
            }
            pending = et;
        } else {
            int64_t rem = top->n;
            if (rem == 0) {
                s->depth--;
                continue;
            }
            /* Fast path: keys and values that are fixed-size or strings, all here. */
            Py_ssize_t p;
            int64_t r = rem;
            const int kt = top->a, vt = top->b;
            while (r > 0 && (p = bin_value_end(buf, pos, end, (r & 1) == 0 ? kt : vt)) >= 0) {
                pos = p;
                r--;
            }
            if (r != rem) {
                top->n = r;
                continue;
            }
            top->n = rem - 1;
            pending = (rem & 1) == 0 ? top->a : top->b;
        }
    }
out:
    /* Bytes passed over plus a partial token's bytes, re-read next time. */
    s->examined += (long long)(pos - start) + ((pos < end && s->depth) ? (long long)(end - pos) : 0);
    s->pos = pos;
    s->pending = pending;
    s->skip = skip;
    return ret;
}

/* -- compact -------------------------------------------------------------- */

/* Offset just past a varint at pos; -1 when incomplete; -2 when longer than 10 bytes
 * (ProtocolError raised if `raise`). */
static inline Py_ssize_t
varint_end(const uint8_t *buf, Py_ssize_t pos, Py_ssize_t end, int raise)
{
    const Py_ssize_t start = pos;
    while (pos < end) {
        if (!(buf[pos] & 0x80))
            return pos + 1;
        pos++;
        if (pos - start >= 10) {
            if (raise)
                protocol_error("bad request: varint longer than 10 bytes");
            return -2;
        }
    }
    return -1;
}

/* A length varint at pos: 1 = read (*value, *next), 0 = incomplete, -1 = bad
 * (ProtocolError raised if `raise`). */
static inline int
read_uvarint(const uint8_t *buf, Py_ssize_t pos, Py_ssize_t end, int raise,
             int64_t *value, Py_ssize_t *next)
{
    uint64_t result = 0;
    int shift = 0;
    const Py_ssize_t start = pos;
    while (pos < end) {
        unsigned b = buf[pos++];
        result |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            if (result > 0x7FFFFFFF) {
                if (raise)
                    protocol_error("bad request: length %llu out of range", (unsigned long long)result);
                return -1;
            }
            *value = (int64_t)result;
            *next = pos;
            return 1;
        }
        shift += 7;
        if (pos - start >= 5) {
            if (raise)
                protocol_error("bad request: length varint longer than 5 bytes");
            return -1;
        }
    }
    return 0;
}

/* End of a fixed-size, varint or string value of type t at pos if it is all here (and valid), else -1. */
static inline Py_ssize_t
cmp_value_end(const uint8_t *buf, Py_ssize_t pos, Py_ssize_t end, int t)
{
    int size = CMP_FIXED[t];
    if (size)
        return end - pos >= size ? pos + size : -1;
    if (t == 4 || t == 5 || t == 6) {
        Py_ssize_t p = varint_end(buf, pos, end, 0);
        return p >= 0 ? p : -1;
    }
    if (t == 8) {
        int64_t n;
        Py_ssize_t p;
        if (read_uvarint(buf, pos, end, 0, &n, &p) == 1 && end - p >= n)
            return p + (Py_ssize_t)n;
    }
    return -1;
}

static int
scan_compact(Scanner *s, const uint8_t *buf, Py_ssize_t end)
{
    Py_ssize_t pos = s->pos;
    const Py_ssize_t start = pos;
    int pending = s->pending;
    int64_t skip = s->skip;
    int ret;

    for (;;) {
        if (skip) {
            Py_ssize_t avail = end - pos;
            if (avail < skip) {
                pos = end;
                skip -= avail;
                ret = 0;
                goto out;
            }
            pos += (Py_ssize_t)skip;
            skip = 0;
        }
        if (pending >= 0) {
            int t = pending;
            int size = CMP_FIXED[t];
            if (size) {
                skip = size;
            } else if (t == 4 || t == 5 || t == 6) {
                Py_ssize_t p = varint_end(buf, pos, end, 1);
                if (p == -2) { ret = -1; goto out; }
                if (p < 0) { ret = 0; goto out; }
                pos = p;
            } else if (t == 8) {
                int64_t n;
                Py_ssize_t p;
                int r = read_uvarint(buf, pos, end, 1, &n, &p);
                if (r < 0) { ret = -1; goto out; }
                if (r == 0) { ret = 0; goto out; }
                skip = n;
                pos = p;
            } else if (t == 12) {
                if (push(s, K_STRUCT, 0, 0, 0) < 0) { ret = -1; goto out; }
            } else if (t == 9 || t == 10) {
                if (pos >= end) { ret = 0; goto out; }
                int b = buf[pos];
                int et = b & 0x0F;
                int64_t n = b >> 4;
                Py_ssize_t p = pos + 1;
                if (n == 15) {
                    int r = read_uvarint(buf, p, end, 1, &n, &p);
                    if (r < 0) { ret = -1; goto out; }
                    if (r == 0) { ret = 0; goto out; }
                }
                if (!CMP_VALID[et]) {
                    protocol_error("bad request: invalid element type %d", et);
                    ret = -1; goto out;
                }
                pos = p;
                if (push(s, K_LIST, et, 0, n) < 0) { ret = -1; goto out; }
            } else {  /* 11 map */
                int64_t n;
                Py_ssize_t p;
                int r = read_uvarint(buf, pos, end, 1, &n, &p);
                if (r < 0) { ret = -1; goto out; }
                if (r == 0) { ret = 0; goto out; }
                int kt = 0, vt = 0;
                if (n) {
                    if (p >= end) { ret = 0; goto out; }
                    kt = buf[p] >> 4;
                    vt = buf[p] & 0x0F;
                    if (!CMP_VALID[kt] || !CMP_VALID[vt]) {
                        protocol_error("bad request: invalid map types %d/%d", kt, vt);
                        ret = -1; goto out;
                    }
                    p += 1;
                }
                pos = p;
                if (push(s, K_MAP, kt, vt, 2 * n) < 0) { ret = -1; goto out; }
            }
            pending = -1;
            continue;
        }
        Frame *top = &s->stack[s->depth - 1];
        if (top->kind == K_STRUCT) {
            /* The struct's fields, one after another while each is a bool, fixed-size,
             * varint or string value all here (no trip round the outer loop per field). */
            int b, t;
            for (;;) {
                if (pos >= end) { ret = 0; goto out; }
                b = buf[pos];
                if (b == 0)
                    break;
                t = b & 0x0F;
                if (!CMP_VALID[t]) {
                    protocol_error("bad request: invalid field type %d", t);
                    ret = -1; goto out;
                }
                Py_ssize_t p = pos + 1;
                if (!(b & 0xF0)) {  /* long form: zigzag varint field id follows */
                    p = varint_end(buf, p, end, 1);
                    if (p == -2) { ret = -1; goto out; }
                    if (p < 0) { ret = 0; goto out; }
                }
                pos = p;
                if (t == 1 || t == 2)  /* bool fields carry their value in the type */
                    continue;
                p = cmp_value_end(buf, pos, end, t);
                if (p < 0)
                    break;
                pos = p;
            }
            if (b == 0) {
                pos += 1;
                if (--s->depth == 0) { ret = 1; goto out; }
                continue;
            }
            if (t == 12) {  /* a struct field: its frame at once (what `pending` would do next) */
                if (push(s, K_STRUCT, 0, 0, 0) < 0) { pending = t; ret = -1; goto out; }
                continue;
            }
            pending = t;
        } else if (top->kind == K_LIST) {
            int64_t n = top->n;
            if (n == 0) {
                s->depth--;
                continue;
            }
            int et = top->a;
            int size = CMP_FIXED[et];
            if (size) {
                int64_t k = (end - pos) / size;
                if (k > n)
                    k = n;
                if (k > 0) {
                    pos += (Py_ssize_t)(k * size);
                    top->n = n - k;
                    continue;
                }
            } else if (et == 4 || et == 5 || et == 6 || et == 8) {
                Py_ssize_t p;
                while (n > 0 && (p = cmp_value_end(buf, pos, end, et)) >= 0) {
                    pos = p;
                    n--;
                }
                if (n != top->n) {
                    top->n = n;
                    continue;
                }
            }
            top->n = n - 1;
            if (et == 12) {  /* a struct element: its frame at once (what `pending` would do next) */
                if (push(s, K_STRUCT, 0, 0, 0) < 0) { pending = et; ret = -1; goto out; }
                continue;
            }
            pending = et;
        } else {
            int64_t rem = top->n;
            if (rem == 0) {
                s->depth--;
                continue;
            }
            Py_ssize_t p;
            int64_t r = rem;
            const int kt = top->a, vt = top->b;
            while (r > 0 && (p = cmp_value_end(buf, pos, end, (r & 1) == 0 ? kt : vt)) >= 0) {
                pos = p;
                r--;
            }
            if (r != rem) {
                top->n = r;
                continue;
            }
            top->n = rem - 1;
            pending = (rem & 1) == 0 ? top->a : top->b;
        }
    }
out:
    s->examined += (long long)(pos - start) + ((pos < end && s->depth) ? (long long)(end - pos) : 0);
    s->pos = pos;
    s->pending = pending;
    s->skip = skip;
    return ret;
}

/* -- the type ------------------------------------------------------------- */

/* A scan of the struct at pos begins: one open struct frame, on the inline stack. */
static void
scanner_start(Scanner *s, int compact, Py_ssize_t pos, Py_ssize_t max_depth)
{
    s->compact = compact;
    s->pos = pos;
    s->examined = 0;
    s->max_depth = max_depth;
    s->pending = -1;
    s->skip = 0;
    s->stack = s->inline_stack;
    s->cap = INLINE_FRAMES;
    s->stack[0].kind = K_STRUCT;
    s->stack[0].a = s->stack[0].b = 0;
    s->stack[0].n = 0;
    s->depth = 1;
}

/* Scan obj[pos:end] (any buffer) from where `s` is: 1 = struct complete, 0 = need more bytes,
 * -1 = error raised (ValueError naming `who` for a bad pos or end). */
static int
scan_buffer(Scanner *s, PyObject *obj, Py_ssize_t end, const char *who)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return -1;
    if (end < 0 || end > view.len || s->pos < 0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "%s(): need 0 <= pos (%zd) and 0 <= end (%zd) <= len(buf) (%zd)",
                     who, s->pos, end, view.len);
        return -1;
    }
    const uint8_t *buf = (const uint8_t *)view.buf;
    int r = s->compact ? scan_compact(s, buf, end) : scan_binary(s, buf, end);
    PyBuffer_Release(&view);
    return r;
}

static int
Scanner_init(Scanner *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"compact", "pos", "max_depth", NULL};
    int compact;
    Py_ssize_t pos = 0;
    Py_ssize_t max_depth = DEFAULT_MAX_DEPTH;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "p|nn:StructScanner", kwlist, &compact, &pos, &max_depth))
        return -1;
    if (self->stack != NULL && self->stack != self->inline_stack)
        PyMem_Free(self->stack);
    scanner_start(self, compact, pos, max_depth);
    return 0;
}

static void
Scanner_dealloc(Scanner *self)
{
    if (self->stack != NULL && self->stack != self->inline_stack)
        PyMem_Free(self->stack);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Scanner_advance(Scanner *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "advance() takes exactly 2 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t end = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (end == -1 && PyErr_Occurred())
        return NULL;
    if (self->stack == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "StructScanner not initialised");
        return NULL;
    }
    if (self->depth == 0)  /* already complete */
        Py_RETURN_TRUE;
    int r = scan_buffer(self, args[0], end, "advance");
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static PyObject *
Scanner_pass_over(Scanner *self, PyObject *arg)
{
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || n > self->skip) {
        PyErr_Format(PyExc_ValueError, "pass_over(%lld): only %lld byte(s) of a value are left to skip",
                     n, (long long)self->skip);
        return NULL;
    }
    self->skip -= n;
    Py_RETURN_NONE;
}

static PyObject *
Scanner_get_reach(Scanner *self, void *closure)
{
    return PyLong_FromLongLong((long long)self->pos + (long long)self->skip);
}

static PyObject *
Scanner_state(Scanner *self, PyObject *unused)
{
    PyObject *frames = PyTuple_New(self->depth);
    if (frames == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->depth; i++) {
        Frame *f = &self->stack[i];
        PyObject *t = Py_BuildValue("(iiiL)", (int)f->kind, (int)f->a, (int)f->b, (long long)f->n);
        if (t == NULL) {
            Py_DECREF(frames);
            return NULL;
        }
        PyTuple_SET_ITEM(frames, i, t);
    }
    return Py_BuildValue("(iLN)", self->pending, (long long)self->skip, frames);
}

static PyMethodDef Scanner_methods[] = {
    {"advance", (PyCFunction)(void (*)(void))Scanner_advance, METH_FASTCALL,
     "advance(buf, end) -> bool\n\nScan buf[pos:end]. True when the struct is complete "
     "(pos is then just past its STOP byte); False = need more bytes."},
    {"pass_over", (PyCFunction)Scanner_pass_over, METH_O,
     "pass_over(n)\n\nCount n bytes of the value being skipped as passed, unseen (they went on "
     "another way: a splice); n <= reach - pos, else ValueError."},
    {"_state", (PyCFunction)Scanner_state, METH_NOARGS,
     "(pending, skip, frames): the resumable state, for tests comparing with the pure scanner."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Scanner_members[] = {
    {"pos", T_PYSSIZET, offsetof(Scanner, pos), 0, "Offset of the next byte to scan."},
    {"examined", T_LONGLONG, offsetof(Scanner, examined), 0,
     "Bytes looked at so far, re-reads of a token cut by a read included."},
    {NULL},
};

static PyGetSetDef Scanner_getset[] = {
    {"reach", (getter)Scanner_get_reach, NULL,
     "The offset the scan is sure to pass (further than pos while a string is skipped).", NULL},
    {NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "proxy.codec._scan.StructScanner",
    .tp_doc = PyDoc_STR("StructScanner(compact, pos=0, max_depth=64)\n\n"
                        "Walks one struct starting at pos; advance() returns True once its end is found."),
    .tp_basicsize = sizeof(Scanner),
    .tp_itemsize = 0,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Scanner_init,
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_methods = Scanner_methods,
    .tp_members = Scanner_members,
    .tp_getset = Scanner_getset,
};

/* struct_end(buf, pos, end, compact): one whole scan with no object made (the listener checks
 * every framed request's body with it: a StructScanner per request cost ~0.25 us). */
static PyObject *
scan_struct_end(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "struct_end() takes exactly 4 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t pos = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t end = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (end == -1 && PyErr_Occurred())
        return NULL;
    int compact = PyObject_IsTrue(args[3]);
    if (compact < 0)
        return NULL;
    Scanner s;
    scanner_start(&s, compact, pos, DEFAULT_MAX_DEPTH);
    int r = scan_buffer(&s, args[0], end, "struct_end");
    if (s.stack != s.inline_stack)
        PyMem_Free(s.stack);
    if (r < 0)
        return NULL;
    if (r == 0)
        Py_RETURN_NONE;
    return PyLong_FromSsize_t(s.pos);
}

static PyMethodDef scan_functions[] = {
    {"struct_end", (PyCFunction)(void (*)(void))scan_struct_end, METH_FASTCALL,
     "struct_end(buf, pos, end, compact) -> int | None\n\nWhere the struct at buf[pos] ends, if by end "
     "(None if not); ProtocolError if it is malformed. A StructScanner's whole scan in one call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef scan_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "proxy.codec._scan",
    .m_doc = "Compiled resumable struct scanner (the C twin of proxy.codec.scan's pure one).",
    .m_size = -1,
    .m_methods = scan_functions,
};

PyMODINIT_FUNC
PyInit__scan(void)
{
    init_tables();
    if (PyType_Ready(&ScannerType) < 0)
        return NULL;
    PyObject *errors = PyImport_ImportModule("proxy.codec.errors");
    if (errors == NULL)
        return NULL;
    PyObject *cls = PyObject_GetAttrString(errors, "ProtocolError");
    Py_DECREF(errors);
    if (cls == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&scan_module);
    if (m == NULL) {
        Py_DECREF(cls);
        return NULL;
    }
    Py_XSETREF(ProtocolError, cls);  /* kept for the process's life */
    Py_INCREF(&ScannerType);
    if (PyModule_AddObject(m, "StructScanner", (PyObject *)&ScannerType) < 0) {
        Py_DECREF(&ScannerType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "DEFAULT_MAX_DEPTH", DEFAULT_MAX_DEPTH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
