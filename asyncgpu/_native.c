/* asyncgpu._native: the CUDA driver calls of the enqueue hot path, called
 * directly through the driver's entry points.
 *
 * cuda.bindings wraps every driver call in Python-level argument conversion
 * (CUstream / CUdeviceptr / cuuint64_t objects, the kernel-parameter helper),
 * which costs about as much as the driver call itself for the tiny calls that
 * asyncgpu makes per operation (a launch, a completion marker). This module
 * takes the entry points from cuGetProcAddress (asked through cuda.bindings,
 * so nothing here links against libcuda) and calls them with plain integers.
 *
 * It also packs kernel arguments: given the argument tuple and a plan (the
 * expected type of each argument and how to pass it), it writes each value
 * into the stream's parameter memory, 8 bytes per argument, and launches. An
 * argument whose type differs from the plan's makes the call return -1 before
 * anything is launched, and the caller takes its general path; so does a
 * buffer that no longer owns memory or whose context is closed (the general
 * path raises the precise error).
 *
 * Limited API (abi3), so one build serves every CPython from 3.10 on. Every
 * driver call releases the GIL, as cuda.bindings does: a launch blocks when
 * the device's queue is full.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*write64_fn)(void *, unsigned long long, unsigned long long, unsigned);

static launch_fn p_launch = NULL;
static write64_fn p_write64 = NULL;
static PyObject *s_ptr, *s_alloc, *s_ctx, *s_state, *s_closed; /* attribute names */

/* Argument codes of a plan (one byte per argument). */
enum {
    A_PTR = 'P',   /* an asyncgpu buffer: its _ptr (checked: _alloc, _ctx._state.closed) */
    A_F32 = 'f',   /* a NumPy float32 (anything float() takes) */
    A_F64 = 'd',
    A_I8 = 'b',
    A_I16 = 'h',
    A_I32 = 'i',
    A_I64 = 'q',   /* also unsigned 64-bit: written as the same 8 bytes */
    A_U8 = 'B',
    A_U16 = 'H',
    A_U32 = 'I',
    A_U64 = 'Q',
};

#define MAX_ARGS 64
#define MARKER_FAILED (1 << 20)

static int as_u64(PyObject *o, unsigned long long *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    unsigned long long a, b;
    PyObject *prev;
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "bind(launch_entry, write64_entry)");
        return NULL;
    }
    if (as_u64(args[0], &a) || as_u64(args[1], &b))
        return NULL;
    if (!a || !b) {
        PyErr_SetString(PyExc_ValueError, "a driver entry point is NULL");
        return NULL;
    }
    prev = Py_BuildValue("(KK)", (unsigned long long)(uintptr_t)p_launch,
                         (unsigned long long)(uintptr_t)p_write64);
    if (prev == NULL)
        return NULL;
    p_launch = (launch_fn)(uintptr_t)a;
    p_write64 = (write64_fn)(uintptr_t)b;
    return prev;
}

static int ready(void) {
    if (p_launch == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "asyncgpu._native is not bound to the driver");
        return 0;
    }
    return 1;
}

/* write64(stream, addr, value) -> CUresult: cuStreamWriteValue64. */
static PyObject *write64(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    unsigned long long st, addr, value;
    int err;
    if (n != 3) {
        PyErr_SetString(PyExc_TypeError, "write64(stream, addr, value)");
        return NULL;
    }
    if (!ready() || as_u64(args[0], &st) || as_u64(args[1], &addr) || as_u64(args[2], &value))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    err = p_write64((void *)(uintptr_t)st, addr, value, 0);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

/* 1 if the buffer ``a`` may be used (it owns memory and its context is open),
 * 0 if not (the caller's general path raises the precise error), -1 on error. */
static int usable(PyObject *a) {
    PyObject *o = PyObject_GetAttr(a, s_alloc), *ctx, *state, *closed;
    int rc;
    if (o == NULL)
        return -1;
    rc = o != Py_None;
    Py_DECREF(o);
    if (rc != 1)
        return 0;
    ctx = PyObject_GetAttr(a, s_ctx);
    if (ctx == NULL)
        return -1;
    state = PyObject_GetAttr(ctx, s_state);
    Py_DECREF(ctx);
    if (state == NULL)
        return -1;
    closed = PyObject_GetAttr(state, s_closed);
    Py_DECREF(state);
    if (closed == NULL)
        return -1;
    rc = PyObject_Not(closed);
    Py_DECREF(closed);
    return rc;
}

/* Write one argument into an 8-byte slot: 0 done, 1 the argument cannot be
 * used here (the general path takes over), -1 with an exception set. */
static int pack_one(char code, PyObject *a, unsigned char *slot) {
    memset(slot, 0, 8);
    switch (code) {
    case A_PTR: {
        PyObject *p;
        unsigned long long v;
        int rc = usable(a);
        if (rc <= 0)
            return rc < 0 ? -1 : 1;
        p = PyObject_GetAttr(a, s_ptr);
        if (p == NULL)
            return -1;
        rc = as_u64(p, &v);
        Py_DECREF(p);
        if (rc)
            return -1;
        memcpy(slot, &v, 8);
        return 0;
    }
    case A_F32: {
        double d = PyFloat_AsDouble(a);
        float f = (float)d;
        if (d == -1.0 && PyErr_Occurred())
            return -1;
        memcpy(slot, &f, 4);
        return 0;
    }
    case A_F64: {
        double d = PyFloat_AsDouble(a);
        if (d == -1.0 && PyErr_Occurred())
            return -1;
        memcpy(slot, &d, 8);
        return 0;
    }
    case A_U64: {
        unsigned long long v;
        PyObject *i = PyNumber_Index(a);
        int rc;
        if (i == NULL)
            return -1;
        rc = as_u64(i, &v);
        Py_DECREF(i);
        if (rc)
            return -1;
        memcpy(slot, &v, 8);
        return 0;
    }
    default: {
        long long v;
        PyObject *i = PyNumber_Index(a);
        if (i == NULL)
            return -1;
        v = PyLong_AsLongLong(i);
        Py_DECREF(i);
        if (v == -1 && PyErr_Occurred())
            return -1;
        switch (code) {
        case A_I8: case A_U8: { int8_t x = (int8_t)v; memcpy(slot, &x, 1); break; }
        case A_I16: case A_U16: { int16_t x = (int16_t)v; memcpy(slot, &x, 2); break; }
        case A_I32: case A_U32: { int32_t x = (int32_t)v; memcpy(slot, &x, 4); break; }
        case A_I64: { memcpy(slot, &v, 8); break; }
        default:
            PyErr_Format(PyExc_ValueError, "unknown argument code %c", code);
            return -1;
        }
        return 0;
    }
    }
}

/* launch(func, dims, stream, types, codes, args, data, pointers[, counter, value])
 *   -> CUresult, or -1 when an argument's type is not the plan's (nothing launched).
 *
 * dims: (gx, gy, gz, bx, by, bz, shmem); types: a tuple of the expected type of
 * each argument; codes: bytes, one code per argument; data: the address of
 * 8 * len(args) bytes of parameter memory; pointers: the address of the array
 * of pointers into it that cuLaunchKernel reads (0 for no arguments). With
 * counter and value, cuStreamWriteValue64(stream, counter, value) follows a
 * successful launch (the completion marker), in the same release of the GIL;
 * if that write fails, the result is MARKER_FAILED + its CUresult.
 */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    unsigned long long func, st, data, ptrs, counter = 0, value = 0, d[7];
    PyObject *dims, *types, *codes, *argt;
    Py_ssize_t nargs, i;
    const char *code;
    int err;
    if (n != 8 && n != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "launch(func, dims, stream, types, codes, args, data, pointers"
                        "[, counter, value])");
        return NULL;
    }
    if (!ready() || as_u64(args[0], &func) || as_u64(args[2], &st) ||
        as_u64(args[6], &data) || as_u64(args[7], &ptrs))
        return NULL;
    if (n == 10 && (as_u64(args[8], &counter) || as_u64(args[9], &value)))
        return NULL;
    dims = args[1];
    types = args[3];
    codes = args[4];
    argt = args[5];
    if (!PyTuple_Check(dims) || PyTuple_Size(dims) != 7 || !PyTuple_Check(types) ||
        !PyBytes_Check(codes) || !PyTuple_Check(argt)) {
        PyErr_SetString(PyExc_TypeError, "launch: dims, types and args are tuples, codes bytes");
        return NULL;
    }
    for (i = 0; i < 7; i++)
        if (as_u64(PyTuple_GetItem(dims, i), &d[i]))
            return NULL;
    nargs = PyTuple_Size(argt);
    if (PyBytes_Size(codes) != PyTuple_Size(types) || nargs > MAX_ARGS) {
        PyErr_SetString(PyExc_ValueError, "launch: a plan has one code per type");
        return NULL;
    }
    if (PyTuple_Size(types) != nargs)
        return PyLong_FromLong(-1); /* another number of arguments than the plan's */
    if (nargs && (data == 0 || ptrs == 0)) {
        PyErr_SetString(PyExc_ValueError, "launch: no parameter memory");
        return NULL;
    }
    code = PyBytes_AsString(codes);
    for (i = 0; i < nargs; i++) {
        PyObject *a = PyTuple_GetItem(argt, i);
        if ((PyObject *)Py_TYPE(a) != PyTuple_GetItem(types, i))
            return PyLong_FromLong(-1);
    }
    for (i = 0; i < nargs; i++) {
        int rc = pack_one(code[i], PyTuple_GetItem(argt, i),
                          (unsigned char *)(uintptr_t)(data + 8 * i));
        if (rc)
            return rc < 0 ? NULL : PyLong_FromLong(-1);
    }
    Py_BEGIN_ALLOW_THREADS
    err = p_launch((void *)(uintptr_t)func, (unsigned)d[0], (unsigned)d[1], (unsigned)d[2],
                   (unsigned)d[3], (unsigned)d[4], (unsigned)d[5], (unsigned)d[6],
                   (void *)(uintptr_t)st, nargs ? (void **)(uintptr_t)ptrs : NULL, NULL);
    if (err == 0 && counter) {
        err = p_write64((void *)(uintptr_t)st, counter, value, 0);
        if (err)
            err += MARKER_FAILED;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(launch_entry, write64_entry) -> the previous pair: the driver's "
     "cuLaunchKernel and cuStreamWriteValue64 entry points (from cuGetProcAddress)."},
    {"write64", (PyCFunction)(void (*)(void))write64, METH_FASTCALL,
     "write64(stream, addr, value) -> CUresult: cuStreamWriteValue64."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(func, dims, stream, types, codes, args, data, pointers[, counter, value]) "
     "-> CUresult (or -1: an argument's type is not the plan's; nothing launched)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "asyncgpu._native",
    "Direct driver calls of asyncgpu's enqueue hot path (see _native.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m;
    s_ptr = PyUnicode_InternFromString("_ptr");
    s_alloc = PyUnicode_InternFromString("_alloc");
    s_ctx = PyUnicode_InternFromString("_ctx");
    s_state = PyUnicode_InternFromString("_state");
    s_closed = PyUnicode_InternFromString("closed");
    if (!s_ptr || !s_alloc || !s_ctx || !s_state || !s_closed)
        return NULL;
    m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "MARKER_FAILED", MARKER_FAILED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
