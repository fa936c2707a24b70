/*
 * proxy._sockq: the compiled twin of proxy/sockets.py's `pure_unsent_bytes` and
 * `pure_unread_bytes`: a TCP socket's queue sizes, read by ioctl.
 *
 *   unsent_bytes(fd)   SIOCOUTQNSD: bytes written and not yet sent to the peer; 0 on error
 *   unread_bytes(fd)   FIONREAD: bytes that arrived and are not read yet; 0 on error
 *   peer_closed(fd)    a FIN or a reset from the peer is waiting unread (recv MSG_PEEK)
 *
 * Why compiled: the listener asks SIOCOUTQNSD after every reply it writes (the write_response
 * hop). `fcntl.ioctl` costs about 1 µs there, and it releases the GIL around the call: with
 * the span export thread alive, taking the GIL back cost the loop about 1.5 µs more per call
 * (bench/hotpath.py, tracing on). These ioctls never block, so this module keeps the GIL.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#ifdef __linux__
#include <linux/sockios.h>
#endif
#ifndef SIOCOUTQNSD
#define SIOCOUTQNSD 0x894B
#endif

static PyObject *
queue_size(PyObject *arg, unsigned long request)
{
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    int n = 0;
    if (fd < 0 || fd > INT_MAX || ioctl((int)fd, request, &n) < 0)
        n = 0;  /* as the pure twin: a closed or non-TCP socket has nothing queued */
    return PyLong_FromLong(n);
}

static PyObject *
unsent_bytes(PyObject *module, PyObject *fd)
{
    return queue_size(fd, SIOCOUTQNSD);
}

static PyObject *
unread_bytes(PyObject *module, PyObject *fd)
{
    return queue_size(fd, FIONREAD);
}

/* Before a pooled upstream connection takes a call: has the upstream closed it already? Its
 * FIN may sit unread in the kernel behind the reply just read (libuv stops reading at a short
 * read), so the transport has not said so yet; a request written on it would be lost and the
 * call told "may have run". One non-blocking peek, nothing consumed. FIONREAD cannot tell: a
 * FIN is no byte. Bytes waiting (a TLS record) are not a close. */
static PyObject *
peer_closed(PyObject *module, PyObject *arg)
{
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT_MAX)
        Py_RETURN_FALSE;
    char b;
    ssize_t n = recv((int)fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0)
        Py_RETURN_TRUE;
    if (n < 0 && (errno == ECONNRESET || errno == EPIPE || errno == ETIMEDOUT || errno == ECONNABORTED))
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;  /* bytes waiting, nothing yet (EAGAIN), or not a socket we can tell about */
}

static PyMethodDef module_methods[] = {
    {"unsent_bytes", unsent_bytes, METH_O,
     "unsent_bytes(fd)\n\nBytes written to a TCP socket not yet sent to the peer (SIOCOUTQNSD); 0 on error."},
    {"unread_bytes", unread_bytes, METH_O,
     "unread_bytes(fd)\n\nBytes arrived on a TCP socket not read yet (FIONREAD); 0 on error."},
    {"peer_closed", peer_closed, METH_O,
     "peer_closed(fd)\n\nWhether the peer's FIN or reset waits unread on a TCP socket (a MSG_PEEK recv)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sockq_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "proxy._sockq",
    .m_doc = "A TCP socket's queue sizes by ioctl, GIL held (the twin of proxy.sockets' pure functions).",
    .m_size = 0,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__sockq(void)
{
    return PyModule_Create(&sockq_module);
}
