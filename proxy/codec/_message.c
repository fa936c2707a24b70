/*
 * proxy.codec._message: the compiled twin of the hot path's message shortcut.
 *
 * Two things, both with a pure-Python twin in proxy/codec/message.py:
 *
 *   MessageBase   the storage of proxy.codec.message.Message: its ten fields as C members
 *                 (object slots, read and written by Python as fast as __slots__ are).
 *                 Message subclasses it and adds the methods; its __init__ sets the fields.
 *   take_framed(data, protocol, max_frame_size) -> Message | None
 *                 `data` as one message when it is exactly one whole framed strict-binary
 *                 message: the same Message (same fields, same values) the pure
 *                 `take_framed` builds, made without running __init__; None for anything else.
 *                 A max_frame_size that is not a plain int goes to the pure one.
 *
 * `bind(Message, FRAMED, BINARY, BINARY_NONSTRICT, max_name_length, pure)` must be called once
 * (by proxy.codec.message) before take_framed: the class to build, the enum members it uses,
 * the pure take_framed.
 * tests/test_codec_take.py checks the twins agree on any input.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    PyObject *name;
    PyObject *type;
    PyObject *seqid;
    PyObject *framing;
    PyObject *protocol;
    PyObject *data;
    PyObject *start;
    PyObject *header;
    PyObject *readable;
    PyObject *body;
} MessageBase;

static PyTypeObject *MessageCls;      /* proxy.codec.message.Message (a MessageBase subclass) */
static PyObject *FRAMED, *BINARY, *BINARY_NONSTRICT;
static Py_ssize_t MAX_NAME = 64 * 1024;
static PyObject *FOUR;                /* the int 4: every framed message starts there */
static PyObject *PURE;                /* proxy.codec.message.PureTakeFramed */

static int
MessageBase_traverse(MessageBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->name);
    Py_VISIT(self->type);
    Py_VISIT(self->seqid);
    Py_VISIT(self->framing);
    Py_VISIT(self->protocol);
    Py_VISIT(self->data);
    Py_VISIT(self->start);
    Py_VISIT(self->header);
    Py_VISIT(self->readable);
    Py_VISIT(self->body);
    return 0;
}

static int
MessageBase_clear(MessageBase *self)
{
    Py_CLEAR(self->name);
    Py_CLEAR(self->type);
    Py_CLEAR(self->seqid);
    Py_CLEAR(self->framing);
    Py_CLEAR(self->protocol);
    Py_CLEAR(self->data);
    Py_CLEAR(self->start);
    Py_CLEAR(self->header);
    Py_CLEAR(self->readable);
    Py_CLEAR(self->body);
    return 0;
}

static void
MessageBase_dealloc(MessageBase *self)
{
    PyObject_GC_UnTrack(self);
    MessageBase_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define M(field, doc) {#field, T_OBJECT_EX, offsetof(MessageBase, field), 0, doc}
static PyMemberDef MessageBase_members[] = {
    M(name, "The method name as sent (maybe `Svc:method`)."),
    M(type, "The message type (1 call, 2 reply, 3 exception, 4 oneway)."),
    M(seqid, "The sequence id."),
    M(framing, "proxy.codec.wire.Framing."),
    M(protocol, "proxy.codec.wire.Protocol."),
    M(data, "The whole wire form."),
    M(start, "Where the protocol message begins in data."),
    M(header, "The THeader block, or None."),
    M(readable, "The buffer the head was read from."),
    M(body, "Offset of the args/result struct in readable."),
    {NULL},
};
#undef M

static PyTypeObject MessageBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "proxy.codec._message.MessageBase",
    .tp_doc = PyDoc_STR("The fields of a Message (proxy.codec.message.Message adds the rest)."),
    .tp_basicsize = sizeof(MessageBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)MessageBase_dealloc,
    .tp_traverse = (traverseproc)MessageBase_traverse,
    .tp_clear = (inquiry)MessageBase_clear,
    .tp_members = MessageBase_members,
};

static inline uint32_t
be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static PyObject *
take_framed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "take_framed() takes exactly 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (MessageCls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "take_framed: bind() was not called");
        return NULL;
    }
    PyObject *data = args[0], *protocol = args[1];
    if (!PyLong_CheckExact(args[2]))
        return PyObject_Vectorcall(PURE, args, 3, NULL);
    if (!PyBytes_CheckExact(data) || (protocol != BINARY && protocol != BINARY_NONSTRICT))
        Py_RETURN_NONE;
    int overflow;
    long long max_frame = PyLong_AsLongLongAndOverflow(args[2], &overflow);
    if (overflow)
        max_frame = overflow > 0 ? LLONG_MAX : LLONG_MIN;
    else if (max_frame == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    if (n < 17)
        Py_RETURN_NONE;
    const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(data);
    int32_t length = (int32_t)be32(p);
    uint32_t first = be32(p + 4);
    int32_t nlen = (int32_t)be32(p + 8);
    unsigned mtype = first & 0xFF;
    if ((long long)length != (long long)n - 4 || (long long)length > max_frame
            || (first & 0xFFFF0000u) != 0x80010000u || mtype < 1 || mtype > 4
            || nlen < 0 || nlen > MAX_NAME || 16 + (Py_ssize_t)nlen >= n)
        Py_RETURN_NONE;
    Py_ssize_t body = 16 + (Py_ssize_t)nlen;
    PyObject *name = NULL, *type = NULL, *seqid = NULL, *bodyo = NULL;
    MessageBase *m = NULL;
    if ((name = PyUnicode_DecodeUTF8((const char *)p + 12, nlen, "replace")) == NULL
            || (type = PyLong_FromLong((long)mtype)) == NULL
            || (seqid = PyLong_FromLong((long)(int32_t)be32(p + 12 + nlen))) == NULL
            || (bodyo = PyLong_FromSsize_t(body)) == NULL
            || (m = (MessageBase *)MessageCls->tp_alloc(MessageCls, 0)) == NULL) {
        Py_XDECREF(name);
        Py_XDECREF(type);
        Py_XDECREF(seqid);
        Py_XDECREF(bodyo);
        return NULL;
    }
    m->name = name;
    m->type = type;
    m->seqid = seqid;
    Py_INCREF(FRAMED);
    m->framing = FRAMED;
    Py_INCREF(protocol);
    m->protocol = protocol;
    Py_INCREF(data);
    m->data = data;
    Py_INCREF(FOUR);
    m->start = FOUR;
    Py_INCREF(Py_None);
    m->header = Py_None;
    Py_INCREF(data);
    m->readable = data;
    m->body = bodyo;
    return (PyObject *)m;
}

static PyObject *
bind(PyObject *module, PyObject *args)
{
    PyObject *cls, *framed, *binary, *nonstrict, *pure;
    Py_ssize_t max_name;
    if (!PyArg_ParseTuple(args, "O!OOOnO:bind", &PyType_Type, &cls, &framed, &binary, &nonstrict, &max_name,
                          &pure))
        return NULL;
    if (!PyCallable_Check(pure)) {
        PyErr_SetString(PyExc_TypeError, "bind: the pure take_framed must be callable");
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)cls, &MessageBaseType)) {
        PyErr_SetString(PyExc_TypeError, "bind: the class must subclass MessageBase");
        return NULL;
    }
    Py_INCREF(cls);
    Py_XSETREF(MessageCls, (PyTypeObject *)cls);
    Py_INCREF(framed);
    Py_XSETREF(FRAMED, framed);
    Py_INCREF(binary);
    Py_XSETREF(BINARY, binary);
    Py_INCREF(nonstrict);
    Py_XSETREF(BINARY_NONSTRICT, nonstrict);
    Py_INCREF(pure);
    Py_XSETREF(PURE, pure);
    MAX_NAME = max_name;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"take_framed", (PyCFunction)(void (*)(void))take_framed, METH_FASTCALL,
     "take_framed(data, protocol, max_frame_size) -> Message | None\n\n"
     "data as one Message when it is exactly one whole framed strict-binary message, else None."},
    {"bind", bind, METH_VARARGS,
     "bind(Message, Framing.FRAMED, Protocol.BINARY, Protocol.BINARY_NONSTRICT, max_name_length, pure)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef message_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "proxy.codec._message",
    .m_doc = "Compiled Message storage and the one-read framed message shortcut (see proxy.codec.message).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__message(void)
{
    if (PyType_Ready(&MessageBaseType) < 0)
        return NULL;
    FOUR = PyLong_FromLong(4);
    if (FOUR == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&message_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&MessageBaseType);
    if (PyModule_AddObject(m, "MessageBase", (PyObject *)&MessageBaseType) < 0) {
        Py_DECREF(&MessageBaseType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
