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
 * buffer that no longer owns memory, whose context is closed or that belongs
 * to another context than the launch's (the general path raises the precise
 * error, or passes a buffer another context may share).
 *
 * Limited API (abi3), so one build serves every CPython from 3.10 on. Every
 * driver call releases the GIL, as cuda.bindings does: a launch blocks when
 * the device's queue is full.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#ifdef _WIN32
#include <windows.h>
#else
#include <time.h>
#endif

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*write64_fn)(void *, unsigned long long, unsigned long long, unsigned);
typedef int (*record_fn)(void *, void *);
typedef int (*query_fn)(void *);
typedef int (*memcpy_fn)(unsigned long long, unsigned long long, size_t, void *);
typedef int (*graph_launch_fn)(void *, void *);

static launch_fn p_launch = NULL;
static write64_fn p_write64 = NULL;
static record_fn p_record = NULL; /* cuEventRecord, or NULL: counter markers only */
static query_fn p_query = NULL;   /* cuEventQuery */
static memcpy_fn p_memcpy = NULL; /* cuMemcpyAsync, or NULL: copies through Python */
/* cuGraphLaunch, or NULL: graph launches through Python */
static graph_launch_fn p_graph_launch = NULL;
static PyObject *s_ptr, *s_alloc, *s_ctx, *s_state, *s_closed; /* attribute names */

/* Argument codes of a plan (one byte per argument). */
enum {
    A_PTR = 'P',   /* an asyncgpu buffer: its _ptr (checked: _alloc, _ctx._state) */
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

/* Python 3.12's and 3.13's headers define Py_RETURN_NONE/TRUE/FALSE without a new
 * reference (those objects are immortal there) even for the limited API of 3.10,
 * so an extension built with them would drop references to None, True and False
 * on 3.10 and 3.11 (which abort with "deallocating True or False"). Ours always
 * take the reference. */
#undef Py_RETURN_NONE
#undef Py_RETURN_TRUE
#undef Py_RETURN_FALSE
#define Py_RETURN_NONE return Py_NewRef(Py_None)
#define Py_RETURN_TRUE return Py_NewRef(Py_True)
#define Py_RETURN_FALSE return Py_NewRef(Py_False)

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
    unsigned long long a, b, r = 0, q = 0, m = 0, g = 0;
    PyObject *prev;
    if (n != 2 && n != 4 && n != 5 && n != 6) {
        PyErr_SetString(PyExc_TypeError, "bind(launch_entry, write64_entry[, record_entry, "
                                         "query_entry[, memcpy_entry[, graph_launch_entry]]])");
        return NULL;
    }
    if (as_u64(args[0], &a) || as_u64(args[1], &b))
        return NULL;
    if (n >= 4 && (as_u64(args[2], &r) || as_u64(args[3], &q)))
        return NULL;
    if (n >= 5 && as_u64(args[4], &m))
        return NULL;
    if (n == 6 && as_u64(args[5], &g))
        return NULL;
    if (!a || !b || (r == 0) != (q == 0)) {
        PyErr_SetString(PyExc_ValueError, "a driver entry point is NULL");
        return NULL;
    }
    prev = Py_BuildValue("(KKKKKK)", (unsigned long long)(uintptr_t)p_launch,
                         (unsigned long long)(uintptr_t)p_write64,
                         (unsigned long long)(uintptr_t)p_record,
                         (unsigned long long)(uintptr_t)p_query,
                         (unsigned long long)(uintptr_t)p_memcpy,
                         (unsigned long long)(uintptr_t)p_graph_launch);
    if (prev == NULL)
        return NULL;
    p_launch = (launch_fn)(uintptr_t)a;
    p_write64 = (write64_fn)(uintptr_t)b;
    p_record = (record_fn)(uintptr_t)r; /* two entry points: no event markers */
    p_query = (query_fn)(uintptr_t)q;
    p_memcpy = (memcpy_fn)(uintptr_t)m; /* 0: CudaStream.copy takes the Python path */
    p_graph_launch = (graph_launch_fn)(uintptr_t)g; /* 0: CudaStream.graph_launch in Python */
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

static int is_none(PyObject *o);

/* The dealloc of this module's C types (and of their Python subclasses, whose
 * own fields Python has dropped by then): untrack, drop the C fields, free. */
static void dealloc_core(PyObject *self, inquiry clear) {
    PyTypeObject *tp = Py_TYPE(self);
    freefunc free_ = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    PyObject_GC_UnTrack(self);
    clear(self);
    free_(self);
    Py_DECREF(tp);
}

/* ---------------------------------------------------------------------------------
 * BufferCore: the fields of a device or host buffer (asyncgpu._buffer._BufferBase
 * subclasses it), in C so that packing a buffer argument reads them directly, the
 * context's enqueue_create_buffer makes a buffer from memory its stream kept
 * without Python, and a dropped device buffer gives its memory back to the stream
 * (buffer_finalize) without Python either.
 */
typedef struct {
    PyObject_HEAD
    PyObject *alloc, *ctx, *dtype, *hostbytes, *owner, *parent;
    unsigned long long ptr;
    Py_ssize_t size, nbytes;
    char owns;
} BufferCore;

static PyTypeObject *buffer_core_type = NULL;
static PyTypeObject *buffer_core_seen[2];
static PyTypeObject *state_core_seen[2];
static PyTypeObject *ref_core_seen[2];
static PyTypeObject *context_core_seen[2];
static PyTypeObject *function_core_seen[2];
static PyTypeObject *event_core_seen[2];
static PyTypeObject *stream_core_seen[2];
static PyTypeObject *spare_core_seen[2];

/* PyObject_TypeCheck with a memo of the last two subclasses seen (each held, so
 * the identity test is sound): the hot paths check the same few Python
 * subclasses of this module's types again and again, and PyType_IsSubtype walks
 * the MRO each time. */
static int is_a(PyObject *o, PyTypeObject *base, PyTypeObject **seen) {
    PyTypeObject *t = Py_TYPE(o);
    if (t == seen[0] || t == seen[1])
        return 1;
    if (!PyType_IsSubtype(t, base))
        return 0;
    Py_INCREF(t);
    Py_XDECREF(seen[1]);
    seen[1] = seen[0];
    seen[0] = t;
    return 1;
}

static PyMemberDef buffer_members[] = {
    {"_alloc", T_OBJECT, offsetof(BufferCore, alloc), 0, NULL},
    {"_ctx", T_OBJECT, offsetof(BufferCore, ctx), 0, NULL},
    {"_dtype", T_OBJECT, offsetof(BufferCore, dtype), 0, NULL},
    {"_hostbytes", T_OBJECT, offsetof(BufferCore, hostbytes), 0, NULL},
    {"_owner", T_OBJECT, offsetof(BufferCore, owner), 0, NULL},
    {"_parent", T_OBJECT, offsetof(BufferCore, parent), 0, NULL},
    {"_ptr", T_ULONGLONG, offsetof(BufferCore, ptr), 0, NULL},
    {"_size", T_PYSSIZET, offsetof(BufferCore, size), 0, NULL},
    {"_nbytes", T_PYSSIZET, offsetof(BufferCore, nbytes), 0, NULL},
    {"_owns", T_BOOL, offsetof(BufferCore, owns), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static int buffer_traverse(PyObject *self, visitproc visit, void *arg) {
    BufferCore *b = (BufferCore *)self;
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(b->alloc);
    Py_VISIT(b->ctx);
    Py_VISIT(b->dtype);
    Py_VISIT(b->hostbytes);
    Py_VISIT(b->owner);
    Py_VISIT(b->parent);
    return 0;
}

static int buffer_clear(PyObject *self) {
    BufferCore *b = (BufferCore *)self;
    Py_CLEAR(b->alloc);
    Py_CLEAR(b->ctx);
    Py_CLEAR(b->dtype);
    Py_CLEAR(b->hostbytes);
    Py_CLEAR(b->owner);
    Py_CLEAR(b->parent);
    return 0;
}

static void buffer_dealloc(PyObject *self) { dealloc_core(self, buffer_clear); }

static void buffer_finalize(PyObject *self); /* below, with the kept buffers */

static PyType_Slot buffer_slots[] = {
    {Py_tp_traverse, (void *)buffer_traverse},
    {Py_tp_clear, (void *)buffer_clear},
    {Py_tp_dealloc, (void *)buffer_dealloc},
    {Py_tp_finalize, (void *)buffer_finalize},
    {Py_tp_members, buffer_members},
    {Py_tp_doc, "The fields of a buffer (asyncgpu._buffer subclasses this); dropping one that "
                "owns memory gives it back (_release_memory, or in C to its stream's kept "
                "buffers)."},
    {0, NULL},
};

static PyType_Spec buffer_spec = {
    "asyncgpu._native.BufferCore", sizeof(BufferCore), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, buffer_slots,
};

/* StateCore: the fields of a context's shared state that every enqueue reads
 * (asyncgpu._context._ContextState subclasses it): closed, and the trace being
 * recorded (None: none). RefCore: whether one reference to a context is open
 * (_Ref subclasses it). Either may be another object in tests: their fields are
 * then attributes, read by name. */
typedef struct {
    PyObject_HEAD
    PyObject *trace;
    char closed;
} StateCore;

typedef struct {
    PyObject_HEAD
    char open;
} RefCore;

static PyTypeObject *state_core_type = NULL, *ref_core_type = NULL;

/* 1 when the state is closed, 0 when open, -1 on error. */
static int state_closed(PyObject *state) {
    PyObject *o;
    int rc;
    if (is_a(state, state_core_type, state_core_seen))
        return ((StateCore *)state)->closed;
    o = PyObject_GetAttr(state, s_closed);
    if (o == NULL)
        return -1;
    rc = PyObject_IsTrue(o);
    Py_DECREF(o);
    return rc;
}

/* ContextCore: the fields of a DeviceContext (defined with its methods below). */
typedef struct {
    PyObject_HEAD
    PyObject *state, *impl, *ref;
} ContextCore;

static PyTypeObject *context_core_type = NULL;

/* FunctionCore: the fields of a DeviceFunction that a launch reads (its
 * context, its backend's function, its cached launch configurations), and a
 * one-entry cache of the last configuration looked up: the geometry it was
 * looked up by (grid_of, block_of) and what the cache held for it (cfg_of).
 * asyncgpu._function.DeviceFunction subclasses it. */
typedef struct {
    PyObject_HEAD
    PyObject *ctx, *impl, *cfgs;
    PyObject *grid_of, *block_of, *cfg_of;
} FunctionCore;

static PyTypeObject *function_core_type = NULL;

/* KernelCore: the field of a compiled CUDA function that every launch reads: the
 * argument plan of its last launch (asyncgpu._devices.cuda.launch._CudaFunction
 * subclasses it). */
typedef struct {
    PyObject_HEAD
    PyObject *last;
} KernelCore;

static PyTypeObject *kernel_core_type = NULL;
static PyTypeObject *kernel_core_seen[2];

/* 1 if the buffer ``a`` may be used (it owns memory and its context is open),
 * 0 if not (the caller's general path raises the precise error), -1 on error.
 * core: ``a`` is a BufferCore (its fields are read directly). open_state: the
 * state of the launching context, which the caller has found open
 * (enqueue_function's, or the stream's own), or NULL: then any open context's
 * buffer is packed. A buffer of a context other than open_state is left to
 * the general path, which applies the rule for buffers of other contexts
 * (ops.check_kernel_buffer): the common case costs the one identity test. */
static int usable(PyObject *a, int core, PyObject *open_state) {
    PyObject *o, *ctx, *state;
    int rc;
    if (core) {
        BufferCore *b = (BufferCore *)a;
        if (is_none(b->alloc) || is_none(b->ctx))
            return 0;
        ctx = b->ctx;
        Py_INCREF(ctx);
    } else {
        o = PyObject_GetAttr(a, s_alloc);
        if (o == NULL)
            return -1;
        rc = o != Py_None;
        Py_DECREF(o);
        if (rc != 1)
            return 0;
        ctx = PyObject_GetAttr(a, s_ctx);
        if (ctx == NULL)
            return -1;
    }
    if (context_core_type != NULL && is_a(ctx, context_core_type, context_core_seen)) {
        state = ((ContextCore *)ctx)->state;
        if (state == NULL) {
            Py_DECREF(ctx);
            return 0;
        }
        Py_INCREF(state);
    } else {
        state = PyObject_GetAttr(ctx, s_state);
    }
    Py_DECREF(ctx);
    if (state == NULL)
        return -1;
    if (state == open_state) {
        Py_DECREF(state);
        return 1;
    }
    if (open_state != NULL) {
        Py_DECREF(state);
        return 0;
    }
    rc = state_closed(state);
    Py_DECREF(state);
    return rc < 0 ? -1 : !rc;
}

/* NumPy's scalar types whose value a launch copies from the object itself, by
 * argument code (NULL: through float() or __index__). Every NumPy scalar keeps
 * its value in the field right after the object header (what NumPy's
 * PyArrayScalar_VAL reads); configure_scalars registers a type only once a
 * sample of it read that way gave the bytes the general conversion gives. */
static PyTypeObject *np_scalar_of[128];
static PyObject *np_scalar_held = NULL; /* a list holding the registered types */

/* The bytes an argument of this code takes in its 8-byte slot (0: not a number). */
static int code_width(char code) {
    switch (code) {
    case A_I8: case A_U8: return 1;
    case A_I16: case A_U16: return 2;
    case A_F32: case A_I32: case A_U32: return 4;
    case A_F64: case A_I64: case A_U64: return 8;
    default: return 0;
    }
}

/* Write one argument into an 8-byte slot: 0 done, 1 the argument cannot be
 * used here (the general path takes over), -1 with an exception set. */
static int pack_one(char code, PyObject *a, unsigned char *slot, PyObject *open_state) {
    memset(slot, 0, 8);
    if ((unsigned char)code < 128 && Py_TYPE(a) == np_scalar_of[(unsigned char)code]) {
        memcpy(slot, (const char *)a + sizeof(PyObject), (size_t)code_width(code));
        return 0;
    }
    switch (code) {
    case A_PTR: {
        PyObject *p;
        unsigned long long v;
        int core = is_a(a, buffer_core_type, buffer_core_seen);
        int rc = usable(a, core, open_state);
        if (rc <= 0)
            return rc < 0 ? -1 : 1;
        if (core) {
            memcpy(slot, &((BufferCore *)a)->ptr, 8);
            return 0;
        }
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

/* The geometry (gx, gy, gz, bx, by, bz, shmem) into d. */
static int parse_dims(PyObject *dims, unsigned long long d[7]) {
    Py_ssize_t i;
    if (!PyTuple_Check(dims) || PyTuple_Size(dims) != 7) {
        PyErr_SetString(PyExc_TypeError, "launch: dims is a tuple of 7 integers");
        return -1;
    }
    for (i = 0; i < 7; i++)
        if (as_u64(PyTuple_GetItem(dims, i), &d[i]))
            return -1;
    return 0;
}

/* 0: the arguments have the plan's types exactly; 1: they do not (nothing may be
 * launched, the general path takes over); -1 with an exception: a bad plan. */
static int plan_matches(PyObject *types, PyObject *codes, PyObject *argt) {
    Py_ssize_t nargs, i;
    if (!PyTuple_Check(types) || !PyBytes_Check(codes) || !PyTuple_Check(argt)) {
        PyErr_SetString(PyExc_TypeError, "launch: types and args are tuples, codes bytes");
        return -1;
    }
    nargs = PyTuple_Size(argt);
    if (PyBytes_Size(codes) != PyTuple_Size(types) || nargs > MAX_ARGS) {
        PyErr_SetString(PyExc_ValueError, "launch: a plan has one code per type");
        return -1;
    }
    if (PyTuple_Size(types) != nargs)
        return 1; /* another number of arguments than the plan's */
    for (i = 0; i < nargs; i++)
        if ((PyObject *)Py_TYPE(PyTuple_GetItem(argt, i)) != PyTuple_GetItem(types, i))
            return 1;
    return 0;
}

/* Pack every argument into its 8-byte slot at data: 0 done, 1 an argument cannot
 * be used here (the general path takes over), -1 with an exception set. */
static int pack_args(PyObject *codes, PyObject *argt, unsigned long long data,
                     PyObject *open_state) {
    const char *code = PyBytes_AsString(codes);
    Py_ssize_t nargs = PyTuple_Size(argt), i;
    if (nargs && data == 0) {
        PyErr_SetString(PyExc_ValueError, "launch: no parameter memory");
        return -1;
    }
    for (i = 0; i < nargs; i++) {
        int rc = pack_one(code[i], PyTuple_GetItem(argt, i),
                          (unsigned char *)(uintptr_t)(data + 8 * i), open_state);
        if (rc)
            return rc;
    }
    return 0;
}

/* cuLaunchKernel, then (counter != 0, and the launch went in) the marker
 * cuStreamWriteValue64(stream, counter, value), in one release of the GIL. */
static int launch_and_mark(unsigned long long func, const unsigned long long d[7],
                           unsigned long long st, Py_ssize_t nargs, unsigned long long ptrs,
                           unsigned long long counter, unsigned long long value) {
    int err;
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
    return err;
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
    Py_ssize_t nargs;
    int rc;
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
    if (parse_dims(args[1], d))
        return NULL;
    rc = plan_matches(args[3], args[4], args[5]);
    if (rc)
        return rc < 0 ? NULL : PyLong_FromLong(-1);
    nargs = PyTuple_Size(args[5]);
    if (nargs && ptrs == 0) {
        PyErr_SetString(PyExc_ValueError, "launch: no parameter memory");
        return NULL;
    }
    rc = pack_args(args[4], args[5], data, NULL);
    if (rc)
        return rc < 0 ? NULL : PyLong_FromLong(-1);
    return PyLong_FromLong(launch_and_mark(func, d, st, nargs, ptrs, counter, value));
}

/* ---------------------------------------------------------------------------------
 * EventCore: the fields of asyncgpu.DeviceEvent, which subclasses it (_event.py). A
 * C type, so that creating the event of an operation costs one allocation, not
 * eleven attribute stores, and the launch below creates it without Python.
 */

static void replace_ref(PyObject **slot, PyObject *new_ref);

typedef struct {
    PyObject_HEAD
    PyObject *stream, *value, *error, *waiters, *keep, *lock, *node, *handle, *timing;
    long long seq;
    char done;
} EventCore;

static PyTypeObject *event_core_type = NULL; /* EventCore */
static PyTypeObject *event_type = NULL;      /* DeviceEvent, set by configure() */

static PyMemberDef event_members[] = {
    {"_stream", T_OBJECT, offsetof(EventCore, stream), 0, NULL},
    {"_seq", T_LONGLONG, offsetof(EventCore, seq), 0, NULL},
    {"_done", T_BOOL, offsetof(EventCore, done), 0, NULL},
    {"_value", T_OBJECT, offsetof(EventCore, value), 0, NULL},
    {"_error", T_OBJECT, offsetof(EventCore, error), 0, NULL},
    {"_waiters", T_OBJECT, offsetof(EventCore, waiters), 0, NULL},
    {"_keep", T_OBJECT, offsetof(EventCore, keep), 0, NULL},
    {"_lock", T_OBJECT, offsetof(EventCore, lock), 0, NULL},
    {"_node", T_OBJECT, offsetof(EventCore, node), 0, NULL},
    {"_handle", T_OBJECT, offsetof(EventCore, handle), 0, NULL},
    {"_timing", T_OBJECT, offsetof(EventCore, timing), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

/* A new event of type tp (the caller's references to stream and keep are not
 * taken: they are increfed here). */
static PyObject *event_new_of(PyTypeObject *tp, PyObject *stream, long long seq, PyObject *keep) {
    allocfunc alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
    EventCore *ev = (EventCore *)alloc(tp, 0);
    if (ev == NULL)
        return NULL;
    if (stream != Py_None) {
        Py_INCREF(stream);
        ev->stream = stream;
    }
    if (keep != Py_None) {
        Py_INCREF(keep);
        ev->keep = keep;
    }
    Py_INCREF(Py_False);
    ev->timing = Py_False;
    ev->seq = seq;
    return (PyObject *)ev;
}

/* DeviceEvent(stream=None, seq=0, keep=None) */
static PyObject *event_tp_new(PyTypeObject *tp, PyObject *args, PyObject *kwds) {
    static char *names[] = {"stream", "seq", "keep", NULL};
    PyObject *stream = Py_None, *keep = Py_None;
    long long seq = 0;
    Py_ssize_t n = PyTuple_Size(args);
    if (kwds == NULL && n <= 3) {
        if (n > 0)
            stream = PyTuple_GetItem(args, 0);
        if (n > 1) {
            seq = PyLong_AsLongLong(PyTuple_GetItem(args, 1));
            if (seq == -1 && PyErr_Occurred())
                return NULL;
        }
        if (n > 2)
            keep = PyTuple_GetItem(args, 2);
    } else if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OLO:DeviceEvent", names, &stream,
                                            &seq, &keep)) {
        return NULL;
    }
    return event_new_of(tp, stream, seq, keep);
}

static int event_traverse(PyObject *self, visitproc visit, void *arg) {
    EventCore *ev = (EventCore *)self;
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(ev->stream);
    Py_VISIT(ev->value);
    Py_VISIT(ev->error);
    Py_VISIT(ev->waiters);
    Py_VISIT(ev->keep);
    Py_VISIT(ev->lock);
    Py_VISIT(ev->node);
    Py_VISIT(ev->handle);
    Py_VISIT(ev->timing);
    return 0;
}

static int event_clear(PyObject *self) {
    EventCore *ev = (EventCore *)self;
    Py_CLEAR(ev->stream);
    Py_CLEAR(ev->value);
    Py_CLEAR(ev->error);
    Py_CLEAR(ev->waiters);
    Py_CLEAR(ev->keep);
    Py_CLEAR(ev->lock);
    Py_CLEAR(ev->node);
    Py_CLEAR(ev->handle);
    Py_CLEAR(ev->timing);
    return 0;
}

static void event_dealloc(PyObject *self) { dealloc_core(self, event_clear); }

static PyObject *s_wake_waiters, *s_trace_end;

/* _finish(value=None, error=None): mark done (unless it already is), drop what
 * the event kept, and wake every waiter (DeviceEvent._wake_waiters). Under the
 * GIL, with no Python code run before the waiters are taken, it is atomic
 * against _add_waiter: no lock is needed. A traced event (node set) first has
 * its trace stamp the end (DeviceEvent._trace_end, with the outcome set), so
 * whoever sees it done finds its trace record complete; that runs Python code
 * before the event is done, which _add_waiter does not mind (the waiters are
 * still taken with done set, below). An untraced one pays the node test. */
static PyObject *event_finish(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    EventCore *ev = (EventCore *)self;
    PyObject *value, *error, *waiters, *keep = NULL;
    int wake;
    if (n > 2) {
        PyErr_SetString(PyExc_TypeError, "_finish(value=None, error=None)");
        return NULL;
    }
    value = n > 0 ? args[0] : Py_None;
    error = n > 1 ? args[1] : Py_None;
    if (!ev->done && !is_none(ev->node)) {
        PyObject *r;
        Py_INCREF(value);
        replace_ref(&ev->value, value);
        Py_INCREF(error);
        replace_ref(&ev->error, error);
        r = PyObject_CallMethodObjArgs(self, s_trace_end, NULL);
        if (r == NULL) /* (a broken trace must not leave the event unfinished) */
            PyErr_WriteUnraisable(self);
        Py_XDECREF(r);
    }
    if (!ev->done) {
        Py_INCREF(value);
        replace_ref(&ev->value, value);
        Py_INCREF(error);
        replace_ref(&ev->error, error);
        ev->done = 1;
        keep = ev->keep; /* dropped last: its release may run any code */
        ev->keep = NULL;
    }
    waiters = ev->waiters;
    ev->waiters = NULL;
    wake = waiters != NULL && waiters != Py_None && PyObject_IsTrue(waiters) == 1;
    Py_XDECREF(keep);
    if (wake) {
        PyObject *r = PyObject_CallMethodObjArgs(self, s_wake_waiters, waiters, NULL);
        Py_DECREF(waiters);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    } else {
        Py_XDECREF(waiters);
    }
    Py_RETURN_NONE;
}

/* _add_waiter(waiter) -> bool: register a waiter; False if the event is already
 * done (the caller resolves it). Atomic under the GIL. */
static PyObject *event_add_waiter(PyObject *self, PyObject *waiter) {
    EventCore *ev = (EventCore *)self;
    if (ev->done)
        Py_RETURN_FALSE;
    if (ev->waiters == NULL || ev->waiters == Py_None) {
        PyObject *l = PyList_New(1);
        if (l == NULL)
            return NULL;
        Py_INCREF(waiter);
        PyList_SetItem(l, 0, waiter);
        replace_ref(&ev->waiters, l);
    } else if (PyList_Append(ev->waiters, waiter)) {
        return NULL;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef event_methods[] = {
    {"_finish", (PyCFunction)(void (*)(void))event_finish, METH_FASTCALL,
     "Mark done and wake every waiter. Called exactly once, from any thread."},
    {"_add_waiter", event_add_waiter, METH_O,
     "Register a waiter; False if the event is already done (caller resolves)."},
    {NULL, NULL, 0, NULL},
};

static PyObject *event_await(PyObject *self); /* (after DirectFuture, below) */

static PyType_Slot event_slots[] = {
    {Py_tp_methods, event_methods},
    {Py_am_await, (void *)event_await},
    {Py_tp_new, (void *)event_tp_new},
    {Py_tp_traverse, (void *)event_traverse},
    {Py_tp_clear, (void *)event_clear},
    {Py_tp_dealloc, (void *)event_dealloc},
    {Py_tp_members, event_members},
    {Py_tp_doc, "The fields of a DeviceEvent (asyncgpu._event subclasses this)."},
    {0, NULL},
};

static PyType_Spec event_spec = {
    "asyncgpu._native.EventCore", sizeof(EventCore), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, event_slots,
};

/* ---------------------------------------------------------------------------------
 * RLock: a re-entrant lock with threading.RLock's Python face (acquire, release,
 * with), which the hot paths below also take and give back in C, without a
 * Python call: through their bound methods, threading.RLock's acquire parses
 * its arguments on every call. benchmarks/diagnostics/primitives_ab.py measures
 * that against a build whose streams use CPython's RLock and deque (the
 * cpython-prims branch), in one run; the figures are in benchmarks/results.
 * A stream's submit, retire and marker locks are these RLocks. Blocking
 * acquires release the GIL and wake for signals, as threading's do.
 *
 * Every acquire and release runs with the GIL held (the lock is never taken
 * from code that has released it), so the GIL guards owner, count and waiters,
 * and a free lock is taken by setting them: no lock operation of the OS (and
 * none of CPython's, which reads the clock on every acquire, even one that
 * does not wait). `wake` is only for waiting: a lock created taken, which a
 * release gives back when a thread waits (so one waiter wakes), and a waiter
 * takes; a waiter that wakes looks again (another thread may have taken the
 * RLock first, or the wake-up was meant for a waiter that left).
 */
typedef struct {
    PyObject_HEAD
    PyThread_type_lock wake;
    unsigned long owner;   /* PyThread_get_thread_ident() of the holder */
    unsigned long count;   /* 0: free */
    unsigned long waiters; /* threads waiting in rlock_take */
} RLockObject;

static PyTypeObject *rlock_type = NULL;

/* 1 taken, 0 not (blocking false, or the timeout passed), -1 with an exception
 * (a signal handler raised). timeout_us < 0: no timeout. */
/* Microseconds of a monotonic clock (only timed waits read it). */
static long long monotonic_us(void) {
#ifdef _WIN32
    return (long long)GetTickCount64() * 1000;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
#endif
}

static int rlock_take(RLockObject *l, int blocking, PY_TIMEOUT_T timeout_us) {
    unsigned long me = PyThread_get_thread_ident();
    long long deadline = 0;
    if (l->count == 0) {
        l->owner = me; /* free: taken (the GIL is held) */
        l->count = 1;
        return 1;
    }
    if (l->owner == me) {
        l->count++;
        return 1;
    }
    if (!blocking || timeout_us == 0)
        return 0;
    if (timeout_us > 0)
        deadline = monotonic_us() + (long long)timeout_us;
    l->waiters++;
    while (l->count > 0) {
        PY_TIMEOUT_T left = -1;
        PyLockStatus r;
        if (timeout_us > 0) {
            long long now = monotonic_us();
            if (now >= deadline)
                break;
            left = (PY_TIMEOUT_T)(deadline - now);
        }
        Py_BEGIN_ALLOW_THREADS
        r = PyThread_acquire_lock_timed(l->wake, left, 1);
        Py_END_ALLOW_THREADS
        if (r == PY_LOCK_INTR && PyErr_CheckSignals()) {
            l->waiters--;
            return -1;
        }
        /* woken, timed out, or a signal whose handler did not raise: look again */
    }
    l->waiters--;
    if (l->count > 0)
        return 0; /* the timeout passed */
    l->owner = me;
    l->count = 1;
    return 1;
}

static int rlock_give(RLockObject *l) {
    if (l->count == 0 || l->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return -1;
    }
    if (--l->count == 0) {
        l->owner = 0;
        if (l->waiters)
            PyThread_release_lock(l->wake);
    }
    return 0;
}

static PyObject *rlock_tp_new(PyTypeObject *tp, PyObject *args, PyObject *kwds) {
    allocfunc alloc;
    RLockObject *l;
    if (PyTuple_Size(args) != 0 || (kwds != NULL && PyDict_Size(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "RLock() takes no arguments");
        return NULL;
    }
    alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
    l = (RLockObject *)alloc(tp, 0);
    if (l == NULL)
        return NULL;
    l->wake = PyThread_allocate_lock();
    if (l->wake == NULL) {
        Py_DECREF(l);
        PyErr_SetString(PyExc_MemoryError, "cannot allocate a lock");
        return NULL;
    }
    PyThread_acquire_lock(l->wake, WAIT_LOCK); /* created taken: see above */
    return (PyObject *)l;
}

static void rlock_dealloc(PyObject *self) {
    RLockObject *l = (RLockObject *)self;
    PyTypeObject *tp = Py_TYPE(self);
    freefunc free_ = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    if (l->wake != NULL) {
        PyThread_release_lock(l->wake);
        PyThread_free_lock(l->wake);
    }
    free_(self);
    Py_DECREF(tp);
}

/* acquire(blocking=True, timeout=-1) -> bool */
static PyObject *rlock_acquire_method(PyObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"blocking", "timeout", NULL};
    int blocking = 1, rc;
    double timeout = -1;
    PY_TIMEOUT_T us = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pd:acquire", names, &blocking, &timeout))
        return NULL;
    if (!blocking && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (timeout < 0 && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
        return NULL;
    }
    if (timeout >= 0) {
        if (timeout * 1e6 >= (double)PY_TIMEOUT_MAX) {
            PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
            return NULL;
        }
        us = (PY_TIMEOUT_T)(timeout * 1e6);
    }
    rc = rlock_take((RLockObject *)self, blocking, us);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyObject *rlock_enter(PyObject *self, PyObject *unused) {
    int rc = rlock_take((RLockObject *)self, 1, -1);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyObject *rlock_release_method(PyObject *self, PyObject *unused) {
    if (rlock_give((RLockObject *)self))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *rlock_exit(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    return rlock_release_method(self, NULL);
}

static PyObject *rlock_is_owned(PyObject *self, PyObject *unused) {
    RLockObject *l = (RLockObject *)self;
    return PyBool_FromLong(l->count > 0 && l->owner == PyThread_get_thread_ident());
}

static PyMethodDef rlock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))rlock_acquire_method, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool, as threading.RLock.acquire."},
    {"release", rlock_release_method, METH_NOARGS, "Release once (as threading.RLock)."},
    {"__enter__", rlock_enter, METH_NOARGS, "acquire()"},
    {"__exit__", (PyCFunction)(void (*)(void))rlock_exit, METH_FASTCALL, "release()"},
    {"_is_owned", rlock_is_owned, METH_NOARGS, "Whether this thread holds the lock."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot rlock_slots[] = {
    {Py_tp_new, (void *)rlock_tp_new},
    {Py_tp_dealloc, (void *)rlock_dealloc},
    {Py_tp_methods, rlock_methods},
    {Py_tp_doc, "A re-entrant lock (threading.RLock's methods) that asyncgpu's C hot paths "
                "take without a Python call."},
    {0, NULL},
};

static PyType_Spec rlock_spec = {
    "asyncgpu._native.RLock", sizeof(RLockObject), 0, Py_TPFLAGS_DEFAULT, rlock_slots,
};

/* A lock the hot paths hold: an RLock taken directly, any other lock (a
 * test's threading.Lock) through its bound acquire and release, cached in
 * *of, *acq, *rel (refreshed when the field holds another lock). */
typedef struct {
    PyObject *lock, *release; /* release: NULL for an RLock */
} Held;

static int cache_methods(PyObject *obj, PyObject **of, PyObject **a, PyObject **b,
                         PyObject *name_a, PyObject *name_b);
static int call0(PyObject *fn);
static PyObject *s_acquire, *s_release; /* (set at module init) */

static int hold(PyObject *lock, PyObject **of, PyObject **acq, PyObject **rel, Held *h) {
    PyObject *acquire;
    int rc;
    if (lock == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "asyncgpu: the stream is not initialised");
        return -1;
    }
    Py_INCREF(lock); /* held while held: a call below may replace the field */
    h->lock = lock;
    h->release = NULL;
    if (Py_TYPE(lock) == rlock_type) {
        if (rlock_take((RLockObject *)lock, 1, -1) == 1)
            return 0;
        Py_DECREF(lock);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "asyncgpu: a lock was not taken");
        return -1;
    }
    if (cache_methods(lock, of, acq, rel, s_acquire, s_release)) {
        Py_DECREF(lock);
        return -1;
    }
    acquire = *acq;
    h->release = *rel;
    Py_INCREF(acquire);
    Py_INCREF(h->release);
    rc = call0(acquire);
    Py_DECREF(acquire);
    if (rc) {
        Py_DECREF(h->release);
        Py_DECREF(lock);
    }
    return rc;
}

/* Give back what hold() took, keeping an exception already set (then -1). */
static int unhold(Held *h) {
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    int failed = PyErr_Occurred() != NULL, rc = 0;
    if (failed)
        PyErr_Fetch(&et, &ev, &tb);
    if (h->release == NULL) {
        rc = rlock_give((RLockObject *)h->lock);
    } else {
        PyObject *r = PyObject_CallNoArgs(h->release);
        if (r == NULL)
            rc = -1;
        Py_XDECREF(r);
        Py_DECREF(h->release);
    }
    Py_DECREF(h->lock);
    if (failed) {
        if (rc)
            PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    return rc;
}

/* ---------------------------------------------------------------------------------
 * EventQueue: a polled stream's events in flight, oldest first (its _inflight).
 * A ring of references with the operations of collections.deque that the streams
 * use: append, popleft, clear, len(q), q[i] (a negative i counts from the end),
 * iteration (through q[i]) and truth. The launch and the retire below reach the
 * ring directly, without a method call; everything else goes through these
 * methods. No method runs Python code between looking and changing (clear drops
 * its references only once the ring is empty), so under the GIL each one is
 * atomic, as the deque's are.
 */
typedef struct {
    PyObject_HEAD
    PyObject **ring;          /* cap slots (NULL while cap is 0) */
    Py_ssize_t cap, head, len; /* cap: 0 or a power of two */
} EventQueue;

static PyTypeObject *event_queue_type = NULL;
#define QUEUE_FIRST_CAP 16
#define QUEUE_SHRINK_ABOVE 4096 /* a ring this large shrinks once it is 1/8 full */

static int is_queue(PyObject *o) { return o != NULL && Py_TYPE(o) == event_queue_type; }

/* The item i places from the oldest (borrowed; 0 <= i < len). */
static PyObject *queue_at(EventQueue *q, Py_ssize_t i) {
    return q->ring[(q->head + i) & (q->cap - 1)];
}

/* Move the items into a new ring of cap slots (cap >= len). */
static int queue_resize(EventQueue *q, Py_ssize_t cap) {
    PyObject **ring;
    Py_ssize_t i;
    if ((size_t)cap > PY_SSIZE_T_MAX / sizeof(PyObject *)) {
        PyErr_NoMemory();
        return -1;
    }
    ring = (PyObject **)PyMem_Malloc((size_t)cap * sizeof(PyObject *));
    if (ring == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < q->len; i++)
        ring[i] = queue_at(q, i);
    PyMem_Free(q->ring);
    q->ring = ring;
    q->cap = cap;
    q->head = 0;
    return 0;
}

/* Append o (the queue takes a new reference); -1 with MemoryError. */
static int queue_push(EventQueue *q, PyObject *o) {
    if (q->len == q->cap && queue_resize(q, q->cap ? q->cap * 2 : QUEUE_FIRST_CAP))
        return -1;
    Py_INCREF(o);
    q->ring[(q->head + q->len) & (q->cap - 1)] = o;
    q->len++;
    return 0;
}

/* Take the oldest item off (the queue's reference, now the caller's), or NULL
 * when the queue is empty (no exception set). */
static PyObject *queue_pop(EventQueue *q) {
    PyObject *o;
    if (q->len == 0)
        return NULL;
    o = q->ring[q->head];
    q->ring[q->head] = NULL;
    q->head = (q->head + 1) & (q->cap - 1);
    q->len--;
    if (q->cap > QUEUE_SHRINK_ABOVE && q->len < q->cap / 8 && queue_resize(q, q->cap / 2))
        PyErr_Clear(); /* no memory for a smaller ring: keep the large one */
    return o;
}

/* Empty the queue, then drop its references (which may run any code: the
 * queue is already consistent, and empty, by then). */
static int queue_clear(PyObject *self) {
    EventQueue *q = (EventQueue *)self;
    PyObject **ring = q->ring;
    Py_ssize_t i, head = q->head, len = q->len, cap = q->cap;
    q->ring = NULL;
    q->cap = q->head = q->len = 0;
    for (i = 0; i < len; i++)
        Py_DECREF(ring[(head + i) & (cap - 1)]);
    PyMem_Free(ring);
    return 0;
}

static int queue_traverse(PyObject *self, visitproc visit, void *arg) {
    EventQueue *q = (EventQueue *)self;
    Py_ssize_t i;
    Py_VISIT(Py_TYPE(self));
    for (i = 0; i < q->len; i++)
        Py_VISIT(queue_at(q, i));
    return 0;
}

static void queue_dealloc(PyObject *self) { dealloc_core(self, queue_clear); }

static Py_ssize_t queue_length(PyObject *self) { return ((EventQueue *)self)->len; }

/* q[i]: sequence indexing has already added len(q) to a negative i. */
static PyObject *queue_item(PyObject *self, Py_ssize_t i) {
    EventQueue *q = (EventQueue *)self;
    PyObject *o;
    if (i < 0 || i >= q->len) {
        PyErr_SetString(PyExc_IndexError, "EventQueue index out of range");
        return NULL;
    }
    o = queue_at(q, i);
    Py_INCREF(o);
    return o;
}

static PyObject *queue_append_method(PyObject *self, PyObject *o) {
    if (queue_push((EventQueue *)self, o))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *queue_popleft_method(PyObject *self, PyObject *unused) {
    PyObject *o = queue_pop((EventQueue *)self);
    if (o == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_IndexError, "pop from an empty EventQueue");
    return o;
}

static PyObject *queue_clear_method(PyObject *self, PyObject *unused) {
    queue_clear(self);
    Py_RETURN_NONE;
}

static PyObject *queue_repr(PyObject *self) {
    return PyUnicode_FromFormat("<asyncgpu EventQueue of %zd>", ((EventQueue *)self)->len);
}

static PyMethodDef queue_methods[] = {
    {"append", queue_append_method, METH_O, "append(ev): add ev at the end (the newest)."},
    {"popleft", queue_popleft_method, METH_NOARGS,
     "popleft() -> the oldest item, taken off; IndexError when empty."},
    {"clear", queue_clear_method, METH_NOARGS, "clear(): drop every item."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot queue_slots[] = {
    {Py_tp_new, (void *)PyType_GenericNew},
    {Py_tp_methods, queue_methods},
    {Py_tp_traverse, (void *)queue_traverse},
    {Py_tp_clear, (void *)queue_clear},
    {Py_tp_dealloc, (void *)queue_dealloc},
    {Py_tp_repr, (void *)queue_repr},
    {Py_sq_length, (void *)queue_length},
    {Py_sq_item, (void *)queue_item},
    {Py_tp_doc, "EventQueue(): the events of a polled stream in flight, oldest first (the "
                "deque operations its streams use: append, popleft, clear, len, q[i], "
                "iteration), which the extension's launch and retire reach directly."},
    {0, NULL},
};

static PyType_Spec queue_spec = {
    "asyncgpu._native.EventQueue", sizeof(EventQueue), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, queue_slots,
};

/* ---------------------------------------------------------------------------------
 * DirectFuture: the future of one asyncio await of a polled stream, which the
 * engine's reactor completes. It keeps asyncio's future protocol (what a Task
 * and asyncio.wait/gather use: _asyncio_future_blocking, _loop,
 * add_done_callback, remove_done_callback, cancel, cancelled, done, result,
 * exception, set_result, iteration), and adds wake(): complete it and run its
 * done callbacks at once, in their contexts, instead of through one
 * loop.call_soon each. The reactor calls wake() from a plain loop callback for
 * a batch of finished awaits, so each awaiting task's step runs there without
 * a Handle of its own. Everything else (set_result, cancel, a callback added
 * once it is done) schedules the callbacks with loop.call_soon, as asyncio's
 * futures do. Its result is its only value; it never holds an exception.
 * It has no get_loop(): a Task and asyncio.futures._get_loop fall back to the
 * _loop member, which spares each await a bound method and a call.
 *
 * Why not asyncio.Future: its set_result hands every done callback, the
 * awaiting task's wake-up included, to loop.call_soon, which costs each await a
 * Handle and runs the task's step one loop iteration after the reactor saw the
 * work finish, where wake() runs it in the reactor's own callback. Waking at
 * once through an asyncio.Future would need its private _callbacks. And a
 * DirectFuture is the await's iterator itself, ending with the event's outcome
 * (event_await below); an asyncio.Future's iterator ends with its own result,
 * so the await would need a Python generator around it.
 */
typedef struct {
    PyObject_HEAD
    PyObject *loop;
    PyObject *cb, *cb_ctx; /* the first done callback (the awaiting task's wake-up), its context */
    PyObject *more;        /* a list of (callback, context) for any further ones, or NULL */
    PyObject *result, *cancel_msg;
    PyObject *event; /* the DeviceEvent whose await it is (event_await), or NULL */
    char state;    /* FUT_PENDING, FUT_DONE or FUT_CANCELLED */
    char blocking; /* _asyncio_future_blocking */
    char yielded;  /* its iterator gave itself to the awaiting task once */
} DirectFuture;

enum { FUT_PENDING, FUT_DONE, FUT_CANCELLED };

static PyTypeObject *direct_future_type = NULL;
/* contextvars.copy_context, asyncio.CancelledError, asyncio.InvalidStateError
 * (configure_futures) */
static PyObject *copy_context_fn = NULL, *cancelled_error = NULL, *invalid_state_error = NULL;
static PyObject *s_call_soon, *s_run, *s_context, *s_msg, *s_loop;

static PyObject *future_tp_new(PyTypeObject *tp, PyObject *args, PyObject *kwds) {
    DirectFuture *f;
    PyObject *loop;
    Py_ssize_t nk = kwds == NULL ? 0 : PyDict_Size(kwds), na = PyTuple_Size(args);
    loop = nk == 1 && na == 0 ? PyDict_GetItem(kwds, s_loop) : NULL;
    if (loop == NULL && nk == 0 && na == 1)
        loop = PyTuple_GetItem(args, 0);
    if (loop == NULL) {
        PyErr_SetString(PyExc_TypeError, "DirectFuture(loop) takes the loop alone");
        return NULL;
    }
    if (copy_context_fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "DirectFuture: configure_futures() was not called");
        return NULL;
    }
    f = (DirectFuture *)((allocfunc)PyType_GetSlot(tp, Py_tp_alloc))(tp, 0);
    if (f == NULL)
        return NULL;
    Py_INCREF(loop);
    f->loop = loop;
    return (PyObject *)f;
}

static int future_traverse(PyObject *self, visitproc visit, void *arg) {
    DirectFuture *f = (DirectFuture *)self;
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(f->loop);
    Py_VISIT(f->cb);
    Py_VISIT(f->cb_ctx);
    Py_VISIT(f->more);
    Py_VISIT(f->result);
    Py_VISIT(f->cancel_msg);
    Py_VISIT(f->event);
    return 0;
}

static int future_clear(PyObject *self) {
    DirectFuture *f = (DirectFuture *)self;
    Py_CLEAR(f->loop);
    Py_CLEAR(f->cb);
    Py_CLEAR(f->cb_ctx);
    Py_CLEAR(f->more);
    Py_CLEAR(f->result);
    Py_CLEAR(f->cancel_msg);
    Py_CLEAR(f->event);
    return 0;
}

static void future_dealloc(PyObject *self) { dealloc_core(self, future_clear); }

/* loop.call_soon(fn, fut, context=ctx); -1 with an exception. */
static int call_soon_with(PyObject *loop, PyObject *fn, PyObject *fut, PyObject *ctx) {
    PyObject *meth, *args, *kw, *r = NULL;
    meth = PyObject_GetAttr(loop, s_call_soon);
    if (meth == NULL)
        return -1;
    args = PyTuple_Pack(2, fn, fut);
    kw = PyDict_New();
    if (args != NULL && kw != NULL && PyDict_SetItem(kw, s_context, ctx) == 0)
        r = PyObject_Call(meth, args, kw);
    Py_DECREF(meth);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Take the callbacks off (a new list of (callback, context) pairs, in the order
 * they were added; NULL with an exception). The future holds none afterwards. */
static PyObject *take_callbacks(DirectFuture *f) {
    PyObject *all = PyList_New(0), *pair;
    if (all == NULL)
        return NULL;
    if (f->cb != NULL) {
        pair = PyTuple_Pack(2, f->cb, f->cb_ctx);
        if (pair == NULL || PyList_Append(all, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(all);
            return NULL;
        }
        Py_DECREF(pair);
        Py_CLEAR(f->cb);
        Py_CLEAR(f->cb_ctx);
    }
    if (f->more != NULL) {
        Py_ssize_t i, n = PyList_Size(f->more);
        for (i = 0; i < n; i++)
            if (PyList_Append(all, PyList_GetItem(f->more, i)) < 0) {
                Py_DECREF(all);
                return NULL;
            }
        Py_CLEAR(f->more);
    }
    return all;
}

/* Schedule every callback of a finished f with loop.call_soon, as asyncio's
 * futures do; -1 with an exception (the callbacks not yet scheduled are lost
 * only if the loop refuses them, i.e. is closed). */
static int schedule_callbacks(DirectFuture *f) {
    PyObject *all;
    Py_ssize_t i, n;
    if (f->cb == NULL && f->more == NULL)
        return 0;
    all = take_callbacks(f);
    if (all == NULL)
        return -1;
    n = PyList_Size(all);
    for (i = 0; i < n; i++) {
        PyObject *pair = PyList_GetItem(all, i);
        if (call_soon_with(f->loop, PyTuple_GetItem(pair, 0), (PyObject *)f,
                           PyTuple_GetItem(pair, 1)) < 0) {
            Py_DECREF(all);
            return -1;
        }
    }
    Py_DECREF(all);
    return 0;
}

/* ctx.run(fn, fut); -1 with the callback's exception. */
static int run_in(PyObject *ctx, PyObject *fn, PyObject *fut) {
    PyObject *r = PyObject_CallMethodObjArgs(ctx, s_run, fn, fut, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* wake(): the hot path of a finished await. Complete the future (result None)
 * and run its done callbacks now, in their contexts, in the order they were
 * added. Call it only from a plain loop callback on the loop's thread, never
 * from inside a task's step: the awaiting task's step runs here. A cancelled
 * or finished future is left as it is. If a callback raises, the ones after it
 * are scheduled with loop.call_soon and the exception propagates. */
static PyObject *future_wake(PyObject *self, PyObject *unused) {
    DirectFuture *f = (DirectFuture *)self;
    PyObject *cb, *ctx, *more;
    Py_ssize_t i, n;
    if (f->state != FUT_PENDING)
        Py_RETURN_NONE;
    f->state = FUT_DONE;
    cb = f->cb; /* the references move here */
    ctx = f->cb_ctx;
    more = f->more;
    f->cb = f->cb_ctx = f->more = NULL;
    if (cb != NULL) {
        int rc = run_in(ctx, cb, self);
        Py_DECREF(cb);
        Py_DECREF(ctx);
        if (rc < 0) {
            if (more != NULL) {
                PyObject *exc_t, *exc_v, *exc_tb;
                PyErr_Fetch(&exc_t, &exc_v, &exc_tb);
                f->more = more;
                if (schedule_callbacks(f) < 0)
                    PyErr_Clear(); /* (the loop is closed: nobody is left to call) */
                PyErr_Restore(exc_t, exc_v, exc_tb);
            }
            return NULL;
        }
    }
    if (more == NULL)
        Py_RETURN_NONE;
    n = PyList_Size(more);
    for (i = 0; i < n; i++) {
        PyObject *pair = PyList_GetItem(more, i);
        if (run_in(PyTuple_GetItem(pair, 1), PyTuple_GetItem(pair, 0), self) < 0) {
            PyObject *exc_t, *exc_v, *exc_tb, *rest;
            PyErr_Fetch(&exc_t, &exc_v, &exc_tb);
            rest = PyList_GetSlice(more, i + 1, n);
            if (rest != NULL && PyList_Size(rest) > 0) {
                replace_ref(&f->more, rest);
                if (schedule_callbacks(f) < 0)
                    PyErr_Clear();
            } else {
                Py_XDECREF(rest);
                PyErr_Clear();
            }
            Py_DECREF(more);
            PyErr_Restore(exc_t, exc_v, exc_tb);
            return NULL;
        }
    }
    Py_DECREF(more);
    Py_RETURN_NONE;
}

static PyObject *future_set_result(PyObject *self, PyObject *value) {
    DirectFuture *f = (DirectFuture *)self;
    if (f->state != FUT_PENDING) {
        PyErr_Format(invalid_state_error, "%s: %R", f->state == FUT_DONE ? "finished" : "cancelled",
                     self);
        return NULL;
    }
    f->state = FUT_DONE;
    Py_INCREF(value);
    replace_ref(&f->result, value);
    if (schedule_callbacks(f) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Raise the CancelledError of a cancelled future (its message, if any). */
static PyObject *raise_cancelled(DirectFuture *f) {
    if (f->cancel_msg == NULL || f->cancel_msg == Py_None)
        PyErr_SetNone(cancelled_error);
    else
        PyErr_SetObject(cancelled_error, f->cancel_msg);
    return NULL;
}

static PyObject *future_result(PyObject *self, PyObject *unused) {
    DirectFuture *f = (DirectFuture *)self;
    if (f->state == FUT_CANCELLED)
        return raise_cancelled(f);
    if (f->state == FUT_PENDING) {
        PyErr_SetString(invalid_state_error, "Result is not set.");
        return NULL;
    }
    if (f->result == NULL)
        Py_RETURN_NONE;
    Py_INCREF(f->result);
    return f->result;
}

static PyObject *future_exception(PyObject *self, PyObject *unused) {
    DirectFuture *f = (DirectFuture *)self;
    if (f->state == FUT_CANCELLED)
        return raise_cancelled(f);
    if (f->state == FUT_PENDING) {
        PyErr_SetString(invalid_state_error, "Exception is not set.");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *future_done(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(((DirectFuture *)self)->state != FUT_PENDING);
}

static PyObject *future_cancelled(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(((DirectFuture *)self)->state == FUT_CANCELLED);
}

/* The keyword argument `name` of a METH_FASTCALL | METH_KEYWORDS call (borrowed;
 * NULL without an exception if absent, NULL with TypeError for any other). */
static int keyword_only(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                        PyObject *name, const char *what, PyObject **out) {
    Py_ssize_t i, nk = kwnames == NULL ? 0 : PyTuple_Size(kwnames);
    *out = NULL;
    for (i = 0; i < nk; i++) {
        PyObject *k = PyTuple_GetItem(kwnames, i);
        int eq = PyObject_RichCompareBool(k, name, Py_EQ);
        if (eq < 0)
            return -1;
        if (!eq) {
            PyErr_Format(PyExc_TypeError, "%s got an unexpected keyword argument %R", what, k);
            return -1;
        }
        *out = args[nargs + i];
    }
    return 0;
}

/* add_done_callback(fn, *, context=None), as asyncio.Future's. */
static PyObject *future_add_done_callback(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                          PyObject *kwnames) {
    DirectFuture *f = (DirectFuture *)self;
    PyObject *fn, *ctx, *pair;
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "add_done_callback(fn, *, context=None)");
        return NULL;
    }
    if (keyword_only(args, nargs, kwnames, s_context, "add_done_callback()", &ctx) < 0)
        return NULL;
    fn = args[0];
    if (ctx == NULL || ctx == Py_None) {
        ctx = PyObject_CallNoArgs(copy_context_fn);
        if (ctx == NULL)
            return NULL;
    } else {
        Py_INCREF(ctx);
    }
    if (f->state != FUT_PENDING) {
        int rc = call_soon_with(f->loop, fn, self, ctx);
        Py_DECREF(ctx);
        if (rc < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    if (f->cb == NULL && f->more == NULL) {
        Py_INCREF(fn);
        f->cb = fn;
        f->cb_ctx = ctx; /* (the reference taken above) */
        Py_RETURN_NONE;
    }
    pair = PyTuple_Pack(2, fn, ctx);
    Py_DECREF(ctx);
    if (pair == NULL)
        return NULL;
    if (f->more == NULL && (f->more = PyList_New(0)) == NULL) {
        Py_DECREF(pair);
        return NULL;
    }
    if (PyList_Append(f->more, pair) < 0) {
        Py_DECREF(pair);
        return NULL;
    }
    Py_DECREF(pair);
    Py_RETURN_NONE;
}

/* remove_done_callback(fn) -> how many were removed (compared with ==). */
static PyObject *future_remove_done_callback(PyObject *self, PyObject *fn) {
    DirectFuture *f = (DirectFuture *)self;
    Py_ssize_t removed = 0;
    if (f->cb != NULL) {
        int eq = PyObject_RichCompareBool(f->cb, fn, Py_EQ);
        if (eq < 0)
            return NULL;
        if (eq) {
            Py_CLEAR(f->cb);
            Py_CLEAR(f->cb_ctx);
            removed++;
        }
    }
    if (f->more != NULL) {
        PyObject *kept = PyList_New(0), *more = f->more;
        Py_ssize_t i, n = PyList_Size(more);
        if (kept == NULL)
            return NULL;
        for (i = 0; i < n; i++) {
            PyObject *pair = PyList_GetItem(more, i);
            int eq = PyObject_RichCompareBool(PyTuple_GetItem(pair, 0), fn, Py_EQ);
            if (eq < 0 || (!eq && PyList_Append(kept, pair) < 0)) {
                Py_DECREF(kept);
                return NULL;
            }
            removed += eq;
        }
        if (PyList_Size(kept) == 0) {
            Py_DECREF(kept);
            Py_CLEAR(f->more);
        } else {
            replace_ref(&f->more, kept);
        }
    }
    return PyLong_FromSsize_t(removed);
}

/* cancel(msg=None) -> False if already finished, else True (the callbacks are
 * scheduled with loop.call_soon). */
static PyObject *future_cancel(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    DirectFuture *f = (DirectFuture *)self;
    PyObject *msg = NULL;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "cancel(msg=None)");
        return NULL;
    }
    if (keyword_only(args, nargs, kwnames, s_msg, "cancel()", &msg) < 0)
        return NULL;
    if (nargs == 1) {
        if (msg != NULL) {
            PyErr_SetString(PyExc_TypeError, "cancel() got msg twice");
            return NULL;
        }
        msg = args[0];
    }
    if (f->state != FUT_PENDING)
        Py_RETURN_FALSE;
    f->state = FUT_CANCELLED;
    if (msg != NULL) {
        Py_INCREF(msg);
        replace_ref(&f->cancel_msg, msg);
    }
    if (schedule_callbacks(f) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *future_iter(PyObject *self) {
    Py_INCREF(self);
    return self;
}

/* End an iteration with value v: StopIteration(v) (NULL, an exception set only
 * when v is not None: none set means the value None). */
static PyObject *stop_with(PyObject *v) {
    if (v != NULL && v != Py_None) {
        PyObject *stop = PyObject_CallFunctionObjArgs(PyExc_StopIteration, v, NULL);
        if (stop != NULL) {
            PyErr_SetObject(PyExc_StopIteration, stop);
            Py_DECREF(stop);
        }
    }
    return NULL;
}

/* End the await of a finished event: raise its error, else stop with its value. */
static PyObject *event_outcome(EventCore *ev) {
    PyObject *e = ev->error;
    if (e != NULL && e != Py_None) {
        if (PyExceptionInstance_Check(e))
            PyErr_SetObject((PyObject *)Py_TYPE(e), e);
        else
            PyErr_Format(PyExc_TypeError, "an event's error is not an exception: %R", e);
        return NULL;
    }
    return stop_with(ev->value);
}

/* The await: give the future itself to the awaiting task once (marked
 * blocking, as asyncio.Future.__await__ does), then end with its result, or,
 * for the await of an event, with the event's outcome. */
static PyObject *future_iternext(PyObject *self) {
    DirectFuture *f = (DirectFuture *)self;
    if (f->state == FUT_PENDING) {
        if (f->yielded) {
            PyErr_SetString(PyExc_RuntimeError, "await wasn't used with future");
            return NULL;
        }
        f->yielded = 1;
        f->blocking = 1;
        Py_INCREF(self);
        return self;
    }
    if (f->state == FUT_CANCELLED)
        return raise_cancelled(f);
    if (f->event != NULL)
        return event_outcome((EventCore *)f->event);
    return stop_with(f->result);
}

static PyObject *future_repr(PyObject *self) {
    DirectFuture *f = (DirectFuture *)self;
    static const char *names[] = {"pending", "finished", "cancelled"};
    return PyUnicode_FromFormat("<asyncgpu DirectFuture %s>", names[(int)f->state]);
}

static PyMemberDef future_members[] = {
    {"_asyncio_future_blocking", T_BOOL, offsetof(DirectFuture, blocking), 0, NULL},
    {"_loop", T_OBJECT, offsetof(DirectFuture, loop), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef future_methods[] = {
    {"wake", future_wake, METH_NOARGS,
     "wake(): finish with result None and run the done callbacks now, in their contexts "
     "(only from a plain callback of the loop, never inside a task); no-op if finished."},
    {"set_result", future_set_result, METH_O,
     "set_result(value): finish; the done callbacks are scheduled with loop.call_soon."},
    {"result", future_result, METH_NOARGS, "result(): as asyncio.Future.result."},
    {"exception", future_exception, METH_NOARGS, "exception(): as asyncio.Future.exception."},
    {"done", future_done, METH_NOARGS, "done(): finished or cancelled."},
    {"cancelled", future_cancelled, METH_NOARGS, "cancelled()"},
    {"add_done_callback", (PyCFunction)(void (*)(void))future_add_done_callback,
     METH_FASTCALL | METH_KEYWORDS, "add_done_callback(fn, *, context=None)"},
    {"remove_done_callback", future_remove_done_callback, METH_O,
     "remove_done_callback(fn) -> the number removed."},
    {"cancel", (PyCFunction)(void (*)(void))future_cancel, METH_FASTCALL | METH_KEYWORDS,
     "cancel(msg=None) -> True unless already finished."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot future_slots[] = {
    {Py_tp_new, (void *)future_tp_new},
    {Py_tp_methods, future_methods},
    {Py_tp_members, future_members},
    {Py_tp_traverse, (void *)future_traverse},
    {Py_tp_clear, (void *)future_clear},
    {Py_tp_dealloc, (void *)future_dealloc},
    {Py_tp_repr, (void *)future_repr},
    {Py_tp_iter, (void *)future_iter},
    {Py_tp_iternext, (void *)future_iternext},
    {Py_am_await, (void *)future_iter},
    {Py_tp_doc, "DirectFuture(loop): the future of one awaited operation of a polled stream, "
                "with asyncio's future protocol; the reactor completes it with wake(), which "
                "runs the awaiting task's step at once instead of through loop.call_soon."},
    {0, NULL},
};

static PyType_Spec future_spec = {
    "asyncgpu._native.DirectFuture", sizeof(DirectFuture), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, future_slots,
};

/* ---------------------------------------------------------------------------------
 * The await of a DeviceEvent (EventCore's am_await): a finished event ends
 * the await at once; else the stream is polled once; else, under a running
 * asyncio loop, the stream's _future(event, loop) gives the future to wait on,
 * and a DirectFuture is itself the await's iterator (it ends with the event's
 * outcome), with no Python generator between the awaiting task and it. Any
 * other case (no stream, no asyncio loop, a future of another type) goes to
 * the Python functions configure_await names.
 */

/* asyncio._get_running_loop, _event._await_event(event), and
 * _event._await_future(event, future) (configure_await) */
static PyObject *running_loop_fn = NULL, *await_event_fn = NULL, *await_future_fn = NULL;
static PyObject *s_poll, *s_future;

/* A finished iterator that ends with ev's outcome (a DirectFuture that is done
 * and already yielded; it belongs to no loop). */
static PyObject *outcome_iter(PyObject *ev) {
    DirectFuture *f = (DirectFuture *)((allocfunc)PyType_GetSlot(direct_future_type,
                                                                  Py_tp_alloc))(direct_future_type, 0);
    if (f == NULL)
        return NULL;
    Py_INCREF(Py_None);
    f->loop = Py_None;
    Py_INCREF(ev);
    f->event = ev;
    f->state = FUT_DONE;
    f->yielded = 1;
    return (PyObject *)f;
}

static PyObject *event_await(PyObject *self) {
    EventCore *ev = (EventCore *)self;
    PyObject *r, *loop, *fut;
    int reached;
    if (ev->done)
        return outcome_iter(self);
    if (await_event_fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "EventCore: configure_await() was not called");
        return NULL;
    }
    if (ev->stream == NULL || ev->stream == Py_None)
        return PyObject_CallFunctionObjArgs(await_event_fn, self, NULL); /* (raises: never recorded) */
    r = PyObject_CallMethodObjArgs(ev->stream, s_poll, self, NULL);
    if (r == NULL)
        return NULL;
    reached = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (reached < 0)
        return NULL;
    if (reached)
        return outcome_iter(self);
    loop = PyObject_CallNoArgs(running_loop_fn);
    if (loop == NULL)
        return NULL;
    if (loop == Py_None) {
        Py_DECREF(loop);
        return PyObject_CallFunctionObjArgs(await_event_fn, self, NULL); /* trio, or no loop at all */
    }
    fut = PyObject_CallMethodObjArgs(ev->stream, s_future, self, loop, NULL);
    Py_DECREF(loop);
    if (fut == NULL)
        return NULL;
    if (fut == Py_None) {
        Py_DECREF(fut);
        return outcome_iter(self);
    }
    if (Py_TYPE(fut) == direct_future_type && ((DirectFuture *)fut)->event == NULL &&
        !((DirectFuture *)fut)->yielded) {
        Py_INCREF(self);
        ((DirectFuture *)fut)->event = self;
        return fut;
    }
    r = PyObject_CallFunctionObjArgs(await_future_fn, self, fut, NULL);
    Py_DECREF(fut);
    return r;
}

/* ---------------------------------------------------------------------------------
 * StreamCore: the bookkeeping fields of a polled stream (_PolledStream and
 * CudaStream subclass it), which the launch below reads and writes directly.
 */

typedef struct {
    PyObject_HEAD
    PyObject *inflight, *pending, *submit_lock, *param_mem, *events, *copy_marks, *retire_lock;
    /* cached: the bound acquire/release of submit_lock and retire_lock, the
     * append and popleft of inflight (when it is not an EventQueue, which the
     * launch and the retire reach directly) */
    PyObject *lock_of, *acquire, *release, *deque_of, *append;
    PyObject *rlock_of, *racquire, *rrelease, *popdeque_of, *popleft;
    /* event markers: _marker_lock (cached acquire/release), _free_events, and
     * the popleft of _copy_marks */
    PyObject *marker_lock, *free_events, *mlock_of, *macquire, *mrelease, *marks_of,
        *marks_popleft;
    /* one-entry caches of the launch path (a kernel launched again and again):
     * the last function's handle, the last plan's types and codes, the last
     * plan's parameter memory (mem_of, found in param_mem for mem_plan; an entry
     * of param_mem never changes once made) and its addresses, the last launch
     * configuration's dimensions
     * (cfg_dims, valid when cfg_of is set). Each holds the object it was read from, so
     * the identity test is sound; what is read never changes after __init__. */
    PyObject *fn_of, *plan_of, *plan_types, *plan_codes, *mem_plan, *mem_of, *cfg_of;
    /* the device buffers the stream keeps (a SpareCore; NULL or None: none) */
    PyObject *spare;
    /* the context state the stream belongs to (_StreamImpl.state): a launch
     * packs buffers of that context only (see usable()) */
    PyObject *state;
    unsigned long long fn_handle, mem_addr, mem_ptrs, cfg_dims[7];
    long long seq, marked, awaited, issued_mark, counter_mark, done_seq;
    unsigned long long h, caddr;
    /* closing: the context is closing (set under the submit lock by
     * _begin_close); every submission, compiled or not, checks it in
     * before_submit, under the same lock, and is refused */
    char eager, touched, after_copy, counter_in_c, kernel_event_markers, closing;
} StreamCore;

static PyTypeObject *stream_core_type = NULL;
static PyObject *sweep_later = NULL; /* the watcher's sweep_later, set by configure() */
static long long mark_every = 32;
static PyObject *s_place_marker, *s_retire, *s_completed, *s_acquire,
    *s_release, *s_append, *s_popleft, *s_finish_retired, *s_need, *s_impl, *s_last,
    *s_dims, *s_handle, *s_launch_general, *s_new_marker_event, *s_types, *s_codes, *s_addr, *s_pointers,
    *s_refuse_closed;

static PyMemberDef stream_members[] = {
    {"_inflight", T_OBJECT, offsetof(StreamCore, inflight), 0, NULL},
    {"_pending", T_OBJECT, offsetof(StreamCore, pending), 0, NULL},
    {"_submit_lock", T_OBJECT, offsetof(StreamCore, submit_lock), 0, NULL},
    {"_param_mem", T_OBJECT, offsetof(StreamCore, param_mem), 0, NULL},
    {"_events", T_OBJECT, offsetof(StreamCore, events), 0, NULL},
    {"_copy_marks", T_OBJECT, offsetof(StreamCore, copy_marks), 0, NULL},
    {"_seq", T_LONGLONG, offsetof(StreamCore, seq), 0, NULL},
    {"_marked", T_LONGLONG, offsetof(StreamCore, marked), 0, NULL},
    {"_awaited", T_LONGLONG, offsetof(StreamCore, awaited), 0, NULL},
    {"_issued_mark", T_LONGLONG, offsetof(StreamCore, issued_mark), 0, NULL},
    {"_counter_mark", T_LONGLONG, offsetof(StreamCore, counter_mark), 0, NULL},
    {"_done_seq", T_LONGLONG, offsetof(StreamCore, done_seq), 0, NULL},
    {"h", T_ULONGLONG, offsetof(StreamCore, h), 0, NULL},
    {"caddr", T_ULONGLONG, offsetof(StreamCore, caddr), 0, NULL},
    {"_eager", T_BOOL, offsetof(StreamCore, eager), 0, NULL},
    {"_touched", T_BOOL, offsetof(StreamCore, touched), 0, NULL},
    {"_after_copy", T_BOOL, offsetof(StreamCore, after_copy), 0, NULL},
    {"_retire_lock", T_OBJECT, offsetof(StreamCore, retire_lock), 0, NULL},
    {"_counter_in_c", T_BOOL, offsetof(StreamCore, counter_in_c), 0, NULL},
    {"_marker_lock", T_OBJECT, offsetof(StreamCore, marker_lock), 0, NULL},
    {"_free_events", T_OBJECT, offsetof(StreamCore, free_events), 0, NULL},
    {"_kernel_event_markers", T_BOOL, offsetof(StreamCore, kernel_event_markers), 0, NULL},
    {"_closing", T_BOOL, offsetof(StreamCore, closing), 0, NULL},
    {"spare", T_OBJECT, offsetof(StreamCore, spare), 0, NULL},
    {"state", T_OBJECT, offsetof(StreamCore, state), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static int stream_traverse(PyObject *self, visitproc visit, void *arg) {
    StreamCore *s = (StreamCore *)self;
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(s->inflight);
    Py_VISIT(s->pending);
    Py_VISIT(s->state);
    Py_VISIT(s->submit_lock);
    Py_VISIT(s->param_mem);
    Py_VISIT(s->events);
    Py_VISIT(s->copy_marks);
    Py_VISIT(s->lock_of);
    Py_VISIT(s->acquire);
    Py_VISIT(s->release);
    Py_VISIT(s->deque_of);
    Py_VISIT(s->append);
    Py_VISIT(s->retire_lock);
    Py_VISIT(s->rlock_of);
    Py_VISIT(s->racquire);
    Py_VISIT(s->rrelease);
    Py_VISIT(s->popdeque_of);
    Py_VISIT(s->popleft);
    Py_VISIT(s->marker_lock);
    Py_VISIT(s->free_events);
    Py_VISIT(s->mlock_of);
    Py_VISIT(s->macquire);
    Py_VISIT(s->mrelease);
    Py_VISIT(s->marks_of);
    Py_VISIT(s->marks_popleft);
    Py_VISIT(s->fn_of);
    Py_VISIT(s->plan_of);
    Py_VISIT(s->plan_types);
    Py_VISIT(s->plan_codes);
    Py_VISIT(s->mem_plan);
    Py_VISIT(s->mem_of);
    Py_VISIT(s->cfg_of);
    Py_VISIT(s->spare);
    return 0;
}

static int stream_clear(PyObject *self) {
    StreamCore *s = (StreamCore *)self;
    Py_CLEAR(s->inflight);
    Py_CLEAR(s->pending);
    Py_CLEAR(s->state);
    Py_CLEAR(s->submit_lock);
    Py_CLEAR(s->param_mem);
    Py_CLEAR(s->events);
    Py_CLEAR(s->copy_marks);
    Py_CLEAR(s->lock_of);
    Py_CLEAR(s->acquire);
    Py_CLEAR(s->release);
    Py_CLEAR(s->deque_of);
    Py_CLEAR(s->append);
    Py_CLEAR(s->retire_lock);
    Py_CLEAR(s->rlock_of);
    Py_CLEAR(s->racquire);
    Py_CLEAR(s->rrelease);
    Py_CLEAR(s->popdeque_of);
    Py_CLEAR(s->popleft);
    Py_CLEAR(s->marker_lock);
    Py_CLEAR(s->free_events);
    Py_CLEAR(s->mlock_of);
    Py_CLEAR(s->macquire);
    Py_CLEAR(s->mrelease);
    Py_CLEAR(s->marks_of);
    Py_CLEAR(s->marks_popleft);
    Py_CLEAR(s->fn_of);
    Py_CLEAR(s->plan_of);
    Py_CLEAR(s->plan_types);
    Py_CLEAR(s->plan_codes);
    Py_CLEAR(s->mem_plan);
    Py_CLEAR(s->mem_of);
    Py_CLEAR(s->cfg_of);
    Py_CLEAR(s->spare);
    return 0;
}

static void stream_dealloc(PyObject *self) { dealloc_core(self, stream_clear); }

static PyObject *stream_retire(PyObject *self, PyObject *unused);
static PyObject *stream_poll(PyObject *self, PyObject *o);
static PyObject *stream_completed_fast(PyObject *self, PyObject *unused);

static PyObject *stream_launch_method(PyObject *self, PyObject *const *args, Py_ssize_t n);
static PyObject *stream_copy_method(PyObject *self, PyObject *const *args, Py_ssize_t n);
static PyObject *stream_graph_method(PyObject *self, PyObject *const *args, Py_ssize_t n);
static PyObject *stream_before_submit(PyObject *self, PyObject *unused);
static PyObject *stream_prune_method(PyObject *self, PyObject *unused);
static PyObject *stream_record_marker_method(PyObject *self, PyObject *arg);
static PyObject *stream_mark_method(PyObject *self, PyObject *keep);

static PyObject *stream_alloc_method(PyObject *self, PyObject *n); /* (below) */

static PyMethodDef stream_methods[] = {
    {"_launch_c", (PyCFunction)(void (*)(void))stream_launch_method, METH_FASTCALL,
     "launch(fn, args, cfg, constant_memory) -> DeviceEvent (CudaStream.launch, in C)."},
    {"_poll", stream_poll, METH_O,
     "Whether ev is done, retiring what has finished (_PolledStream._poll, in C)."},
    {"_completed_fast", stream_completed_fast, METH_NOARGS,
     "The highest sequence number known to have finished, read from the counter "
     "(a CudaStream's _completed)."},
    {"_retire", stream_retire, METH_NOARGS,
     "Finish, in order, every event the markers have passed; True when nothing is "
     "left in flight (_PolledStream._retire, in C)."},
    {"_copy_c", (PyCFunction)(void (*)(void))stream_copy_method, METH_FASTCALL,
     "_copy_c(dst, src, nbytes, keep) -> DeviceEvent, or None: CudaStream.copy's "
     "submission in one call (None: the stream is held; the Python path queues it)."},
    {"_graph_c", (PyCFunction)(void (*)(void))stream_graph_method, METH_FASTCALL,
     "_graph_c(exe, lock, applied, want, keep) -> DeviceEvent, or None: "
     "CudaStream.graph_launch's submission in one call (None: held, unbound, or "
     "the graph's parameters are to be set first; the Python path takes it)."},
    {"_before_submit", stream_before_submit, METH_NOARGS,
     "Under _submit_lock, before a new operation is submitted: the marker rules "
     "(_PolledStream._before_submit's docstring)."},
    {"_mark_c", stream_mark_method, METH_O,
     "_mark_c(keep) -> DeviceEvent: the event of the operation just submitted, under "
     "the submit lock (a CudaStream's _mark)."},
    {"_prune_c", stream_prune_method, METH_NOARGS,
     "Retire what has finished and have the watcher sweep the stream later "
     "(a CudaStream's _prune)."},
    {"_alloc_device_c", stream_alloc_method, METH_O,
     "_alloc_device_c(nbytes): new device memory for this stream from its backend "
     "(cuMemAllocFromPoolAsync), under the submit lock; ContextClosedError once "
     "close() has begun (a polled stream's alloc_device)."},
    {"_record_marker_c", stream_record_marker_method, METH_O,
     "_record_marker_c(seq): a marker for operation seq as a recorded driver event "
     "(cuEventRecord), appended to _events, or else to _copy_marks."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot stream_slots[] = {
    {Py_tp_methods, stream_methods},
    {Py_tp_traverse, (void *)stream_traverse},
    {Py_tp_clear, (void *)stream_clear},
    {Py_tp_dealloc, (void *)stream_dealloc},
    {Py_tp_members, stream_members},
    {Py_tp_doc, "The bookkeeping fields of a polled stream (asyncgpu._stream subclasses this)."},
    {0, NULL},
};

static PyType_Spec stream_spec = {
    "asyncgpu._native.StreamCore", sizeof(StreamCore), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, stream_slots,
};

static int is_none(PyObject *o) { return o == NULL || o == Py_None; }

/* Store a new reference in *slot, dropping the old one (Py_XSETREF is not in
 * the limited API). */
static void replace_ref(PyObject **slot, PyObject *new_ref) {
    PyObject *old = *slot;
    *slot = new_ref;
    Py_XDECREF(old);
}

/* The bound methods name_a and name_b of obj, cached in *a and *b and refreshed
 * when the field now holds another object than *of. */
static int cache_methods(PyObject *obj, PyObject **of, PyObject **a, PyObject **b,
                         PyObject *name_a, PyObject *name_b) {
    PyObject *ma, *mb;
    if (*of == obj && *a != NULL && (b == NULL || *b != NULL))
        return 0;
    if (obj == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "asyncgpu: the stream is not initialised");
        return -1;
    }
    ma = PyObject_GetAttr(obj, name_a);
    if (ma == NULL)
        return -1;
    mb = b == NULL ? NULL : PyObject_GetAttr(obj, name_b);
    if (b != NULL && mb == NULL) {
        Py_DECREF(ma);
        return -1;
    }
    Py_INCREF(obj);
    replace_ref(of, obj);
    replace_ref(a, ma);
    if (b != NULL)
        replace_ref(b, mb);
    return 0;
}

static int call_method0(PyObject *obj, PyObject *name) {
    PyObject *r = PyObject_CallMethodObjArgs(obj, name, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int call0(PyObject *fn) {
    PyObject *r = PyObject_CallNoArgs(fn);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* How many events are in flight, or -1 with an exception. */
static Py_ssize_t inflight_len(StreamCore *s) {
    if (is_queue(s->inflight))
        return ((EventQueue *)s->inflight)->len;
    return PyObject_Size(s->inflight);
}

/* The event at index i of the in-flight queue (a new reference; a negative i
 * counts from the end), or NULL. */
static EventCore *inflight_at(StreamCore *s, Py_ssize_t i) {
    PyObject *o;
    if (is_queue(s->inflight)) {
        EventQueue *q = (EventQueue *)s->inflight;
        if (i < 0)
            i += q->len;
        if (i < 0 || i >= q->len) {
            PyErr_SetString(PyExc_IndexError, "EventQueue index out of range");
            return NULL;
        }
        o = queue_at(q, i);
        Py_INCREF(o);
    } else {
        o = PySequence_GetItem(s->inflight, i);
        if (o == NULL)
            return NULL;
    }
    if (!is_a(o, event_core_type, event_core_seen)) {
        Py_DECREF(o);
        PyErr_SetString(PyExc_TypeError, "asyncgpu: a stream holds something not an event");
        return NULL;
    }
    return (EventCore *)o;
}

/* _PolledStream._before_submit (the rules are documented there). */
static int before_submit(StreamCore *s) {
    Py_ssize_t n;
    EventCore *tail;
    int held;
    if (s->closing) {
        /* _refuse_closed raises the context's ContextClosedError */
        if (call_method0((PyObject *)s, s_refuse_closed) == 0)
            PyErr_SetString(PyExc_RuntimeError, "asyncgpu: _refuse_closed returned");
        return -1;
    }
    n = inflight_len(s);
    if (n < 0)
        return -1;
    if (n == 0) {
        if (s->eager && s->seq > s->awaited)
            s->eager = 0; /* drained, and its last operation was not awaited */
        return 0;
    }
    tail = inflight_at(s, -1);
    if (tail == NULL)
        return -1;
    held = Py_REFCNT((PyObject *)tail) > 2; /* more than the queue's and ours */
    if (tail->seq > s->marked) {
        if (held || tail->seq - s->marked >= mark_every) {
            Py_DECREF(tail);
            return call_method0((PyObject *)s, s_place_marker);
        }
    } else if (s->eager && tail->seq > s->awaited && !held) {
        s->eager = 0; /* nobody awaited or kept the last event: go lazy */
    }
    Py_DECREF(tail);
    return 0;
}

/* _before_submit(): before_submit above, for the submissions made in Python. */
static PyObject *stream_before_submit(PyObject *self, PyObject *unused) {
    if (before_submit((StreamCore *)self))
        return NULL;
    Py_RETURN_NONE;
}

/* The driver handle of a CUevent (cuda.bindings' object, or an int). */
static int event_handle(PyObject *e, unsigned long long *h) {
    PyObject *i = PyNumber_Long(e);
    int rc;
    if (i == NULL)
        return -1;
    rc = as_u64(i, h);
    Py_DECREF(i);
    return rc;
}

static int lock_markers(StreamCore *s, Held *h) {
    return hold(s->marker_lock, &s->mlock_of, &s->macquire, &s->mrelease, h);
}

/* Release _marker_lock, keeping an exception already set. */
static int unlock_markers(Held *h) { return unhold(h); }

/* The (seq, event) of a marker event (event borrowed), or -1 with an exception. */
static int mark_parts(PyObject *mark, long long *seq, PyObject **e) {
    if (!PyTuple_Check(mark) || PyTuple_Size(mark) != 2) {
        PyErr_SetString(PyExc_TypeError, "asyncgpu: a marker is (seq, event)");
        return -1;
    }
    *seq = PyLong_AsLongLong(PyTuple_GetItem(mark, 0));
    *e = PyTuple_GetItem(mark, 1);
    return *seq == -1 && PyErr_Occurred() ? -1 : 0;
}

/* 1 when cuEventQuery says the marker event e finished, 0 when not, -1 on error. */
static int mark_finished(PyObject *e) {
    unsigned long long h;
    if (event_handle(e, &h))
        return -1;
    return p_query((void *)(uintptr_t)h) == 0;
}

/* With the newest marker event of `marks` finished, every one has (stream
 * order): all their events go back to _free_events, the queue is emptied and
 * done_seq is the newest's. 1 when so, 0 when the newest has not finished, -1
 * on error. */
static int take_all_marks(StreamCore *s, PyObject *marks, Py_ssize_t n) {
    PyObject *tail = PySequence_GetItem(marks, n - 1), *e, *r;
    long long seq;
    Py_ssize_t i;
    int finished;
    if (tail == NULL)
        return -1;
    finished = mark_parts(tail, &seq, &e) ? -1 : mark_finished(e);
    Py_DECREF(tail);
    if (finished <= 0)
        return finished;
    for (i = 0; i < n; i++) {
        PyObject *mark = PySequence_GetItem(marks, i);
        long long si;
        int bad = mark == NULL || mark_parts(mark, &si, &e) || PyList_Append(s->free_events, e);
        Py_XDECREF(mark);
        if (bad)
            return -1;
    }
    r = PyObject_CallMethod(marks, "clear", NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    if (seq > s->done_seq)
        s->done_seq = seq;
    return 1;
}

/* Under _marker_lock, retire the marker events of `marks` (in order: _copy_marks
 * with counter completion, _events with event completion) that the counter has
 * passed (counter completion; 0 with event completion) or that cuEventQuery says
 * finished, into done_seq; their events go back to _free_events, to be recorded
 * again. With event completion, where every marker is an event and many may be
 * outstanding, the newest is asked first (take_all_marks). */
static int query_marks(StreamCore *s, PyObject *marks, long long counter, int newest_first) {
    Held mh;
    int rc = 0;
    if (lock_markers(s, &mh))
        return -1;
    if (cache_methods(marks, &s->marks_of, &s->marks_popleft, NULL, s_popleft, NULL)) {
        unlock_markers(&mh);
        return -1;
    }
    if (newest_first) {
        Py_ssize_t n = PyObject_Size(marks);
        rc = n < 0 ? -1 : n == 0 ? 1 : take_all_marks(s, marks, n);
        if (rc != 0)
            return unlock_markers(&mh) || rc < 0 ? -1 : 0;
    }
    for (;;) {
        PyObject *head, *e, *r;
        long long seq;
        int finished;
        Py_ssize_t n = PyObject_Size(marks);
        if (n <= 0) {
            rc = n < 0 ? -1 : 0;
            break;
        }
        head = PySequence_GetItem(marks, 0);
        if (head == NULL || mark_parts(head, &seq, &e)) {
            Py_XDECREF(head);
            rc = -1;
            break;
        }
        finished = seq <= counter ? 1 : mark_finished(e);
        if (finished <= 0) {
            Py_DECREF(head);
            rc = finished;
            break;
        }
        r = PyObject_CallNoArgs(s->marks_popleft);
        Py_XDECREF(r);
        if (r == NULL || PyList_Append(s->free_events, e)) {
            Py_DECREF(head);
            rc = -1;
            break;
        }
        if (seq > s->done_seq)
            s->done_seq = seq;
        Py_DECREF(head);
    }
    if (unlock_markers(&mh))
        rc = -1;
    return rc;
}

/* A marker as a driver event: the one right after an eager launch
 * (cuEventRecord costs the host a third of cuStreamWriteValue64), after a copy or
 * memset, and every marker with event completion. Under _marker_lock, a free
 * event (or a new one, _new_marker_event) recorded on the stream, appended as
 * (seq, event) to _events (event completion), else to _copy_marks. */
static int record_marker(StreamCore *s, long long seq) {
    PyObject *e = NULL, *mark, *marks = is_none(s->events) ? s->copy_marks : s->events;
    Held mh;
    Py_ssize_t n;
    unsigned long long h;
    int err;
    if (lock_markers(s, &mh))
        return -1;
    n = PyList_Check(s->free_events) ? PyList_Size(s->free_events) : -1;
    if (n < 0) {
        PyErr_SetString(PyExc_TypeError, "asyncgpu: _free_events is a list");
        return unlock_markers(&mh), -1;
    }
    if (n > 0) {
        e = PyList_GetItem(s->free_events, n - 1);
        Py_INCREF(e);
        if (PyList_SetSlice(s->free_events, n - 1, n, NULL)) {
            Py_DECREF(e);
            return unlock_markers(&mh), -1;
        }
    } else {
        e = PyObject_CallMethodObjArgs((PyObject *)s, s_new_marker_event, NULL);
        if (e == NULL)
            return unlock_markers(&mh), -1;
    }
    if (event_handle(e, &h)) {
        Py_DECREF(e);
        return unlock_markers(&mh), -1;
    }
    err = p_record((void *)(uintptr_t)h, (void *)(uintptr_t)s->h);
    if (err) {
        PyObject *r;
        PyList_Append(s->free_events, e);
        Py_DECREF(e);
        r = PyObject_CallMethod((PyObject *)s, "_driver_error", "is", err, "cuEventRecord");
        Py_XDECREF(r);
        if (r != NULL)
            PyErr_SetString(PyExc_RuntimeError, "asyncgpu: _driver_error returned");
        return unlock_markers(&mh), -1;
    }
    mark = Py_BuildValue("(LN)", seq, e); /* takes the reference to e */
    if (mark == NULL)
        return unlock_markers(&mh), -1;
    if (marks == NULL) {
        Py_DECREF(mark);
        PyErr_SetString(PyExc_RuntimeError, "asyncgpu: the stream is not initialised");
        return unlock_markers(&mh), -1;
    }
    {
        PyObject *r = PyObject_CallMethodObjArgs(marks, s_append, mark, NULL);
        Py_DECREF(mark);
        if (r == NULL)
            return unlock_markers(&mh), -1;
        Py_DECREF(r);
    }
    return unlock_markers(&mh);
}

/* _record_marker_c(seq): record_marker above, for the markers placed in Python. */
static PyObject *stream_record_marker_method(PyObject *self, PyObject *arg) {
    long long seq = PyLong_AsLongLong(arg);
    if (seq == -1 && PyErr_Occurred())
        return NULL;
    if (p_record == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "asyncgpu._native is not bound to cuEventRecord");
        return NULL;
    }
    if (record_marker((StreamCore *)self, seq))
        return NULL;
    Py_RETURN_NONE;
}

/* _PolledStream._completed: the highest sequence number known to have finished.
 * With _counter_in_c (a CudaStream): with counter completion, read from its
 * counter in host-mapped memory at caddr and, while marker events after copies
 * are outstanding, from cuEventQuery; with event completion (_events), from
 * cuEventQuery alone (query_marks). Without it (streams of tests, or no
 * counter): the stream's own _completed(). */
static int completed(StreamCore *s, long long *out) {
    PyObject *r, *marks;
    Py_ssize_t n;
    long long c = 0;
    if (!s->counter_in_c) {
        r = PyObject_CallMethodObjArgs((PyObject *)s, s_completed, NULL);
        if (r == NULL)
            return -1;
        *out = PyLong_AsLongLong(r);
        Py_DECREF(r);
        return *out == -1 && PyErr_Occurred() ? -1 : 0;
    }
    marks = is_none(s->events) ? s->copy_marks : s->events;
    n = marks == NULL ? 0 : PyObject_Size(marks);
    if (n < 0)
        return -1;
    if (is_none(s->events)) {
        if (!s->caddr) {
            PyErr_SetString(PyExc_RuntimeError, "asyncgpu: the stream has no counter");
            return -1;
        }
        c = (long long)*(volatile unsigned long long *)(uintptr_t)s->caddr;
    }
    if (n > 0) {
        if (p_query == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "asyncgpu._native is not bound to cuEventQuery");
            return -1;
        }
        if (query_marks(s, marks, c, !is_none(s->events)))
            return -1;
    }
    *out = s->done_seq > c ? s->done_seq : c;
    return 0;
}

/* _completed_fast() -> int: completed() above, for a CudaStream's _completed. */
static PyObject *stream_completed_fast(PyObject *self, PyObject *unused) {
    long long c;
    if (!((StreamCore *)self)->counter_in_c) {
        PyErr_SetString(PyExc_RuntimeError, "_completed_fast needs _counter_in_c");
        return NULL;
    }
    if (completed((StreamCore *)self, &c))
        return NULL;
    return PyLong_FromLongLong(c);
}

/* Finish one retired event: here when it has no value (a kernel, copy or
 * memset: set done, drop what it kept, and wake its waiters through _finish),
 * else through the stream's _finish_retired (host results). */
static int finish_retired(StreamCore *s, PyObject *o) {
    if (is_a(o, event_core_type, event_core_seen)) {
        EventCore *ev = (EventCore *)o;
        if (ev->lock == NULL && is_none(ev->value)) {
            PyObject *args[2], *r;
            if (is_none(ev->waiters) && is_none(ev->node)) {
                if (ev->done)
                    return 0;
                ev->done = 1;
                Py_CLEAR(ev->keep);
                return 0;
            }
            /* Waited on or traced: ev._finish(None, ev._error) as _finish_retired
             * would call it, without the Python frame. */
            args[0] = Py_None;
            args[1] = ev->error == NULL ? Py_None : ev->error;
            Py_INCREF(args[1]);
            r = event_finish(o, args, 2);
            Py_DECREF(args[1]);
            if (r == NULL)
                return -1;
            Py_DECREF(r);
            return 0;
        }
    }
    {
        PyObject *r = PyObject_CallMethodObjArgs((PyObject *)s, s_finish_retired, o, NULL);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* _PolledStream._retire: finish, in order, every event the markers have passed;
 * True when nothing is left in flight. Under _retire_lock the finished events are
 * taken off the in-flight queue (into a C array); they are finished after it is
 * released, each even when finishing an earlier one raised (the first error is
 * raised at the end). */
static PyObject *stream_retire(PyObject *self, PyObject *unused) {
    StreamCore *s = (StreamCore *)self;
    PyObject *small[64], **done = small; /* the events taken off, oldest first */
    PyObject *et = NULL, *evv = NULL, *tb = NULL;
    Held rh;
    long long c;
    Py_ssize_t n, i, ndone = 0, room = 64;
    int empty = 0, failed = 0;
    if (hold(s->retire_lock, &s->rlock_of, &s->racquire, &s->rrelease, &rh))
        return NULL;
    if (completed(s, &c) == 0) {
        for (;;) {
            EventCore *head;
            PyObject *r;
            n = inflight_len(s);
            if (n <= 0) {
                empty = n == 0;
                failed = n < 0;
                break;
            }
            head = inflight_at(s, 0);
            if (head == NULL) {
                failed = 1;
                break;
            }
            if (head->seq > c) {
                Py_DECREF(head);
                break;
            }
            Py_DECREF(head);
            if (ndone == room) {
                PyObject **more = (size_t)room > PY_SSIZE_T_MAX / (2 * sizeof(PyObject *))
                                      ? NULL
                                      : (PyObject **)PyMem_Malloc(2 * (size_t)room * sizeof(PyObject *));
                if (more == NULL) {
                    PyErr_NoMemory();
                    failed = 1;
                    break;
                }
                memcpy(more, done, (size_t)ndone * sizeof(PyObject *));
                if (done != small)
                    PyMem_Free(done);
                done = more;
                room *= 2;
            }
            /* (the queue's head is there, n > 0: queue_pop cannot come back empty;
             * the field is looked at each time, as completed() may run Python) */
            if (is_queue(s->inflight))
                r = queue_pop((EventQueue *)s->inflight);
            else if (cache_methods(s->inflight, &s->popdeque_of, &s->popleft, NULL, s_popleft,
                                   NULL))
                r = NULL;
            else
                r = PyObject_CallNoArgs(s->popleft);
            if (r == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_RuntimeError, "asyncgpu: the in-flight queue emptied");
                failed = 1;
                break;
            }
            done[ndone++] = r;
        }
    } else {
        failed = 1;
    }
    if (failed)
        PyErr_Fetch(&et, &evv, &tb);
    if (unhold(&rh)) {
        if (!failed)
            PyErr_Fetch(&et, &evv, &tb);
        failed = 1;
    }
    for (i = 0; i < ndone; i++) {
        if (finish_retired(s, done[i]) && !failed) {
            PyErr_Fetch(&et, &evv, &tb);
            failed = 1;
        } else if (PyErr_Occurred()) {
            PyErr_Clear(); /* a later error: the first one is raised */
        }
    }
    for (i = 0; i < ndone; i++)
        Py_DECREF(done[i]);
    if (done != small)
        PyMem_Free(done);
    if (failed) {
        PyErr_Restore(et, evv, tb);
        return NULL;
    }
    return PyBool_FromLong(empty);
}

/* _poll(ev) -> bool: _PolledStream._poll (a marker covering ev, placed by
 * _need when none does yet; ev counted as awaited; retire if the markers have
 * passed it); whether ev is done. */
static PyObject *stream_poll(PyObject *self, PyObject *o) {
    StreamCore *s = (StreamCore *)self;
    EventCore *ev;
    long long c;
    if (!is_a(o, event_core_type, event_core_seen)) {
        PyErr_SetString(PyExc_TypeError, "_poll: not a DeviceEvent");
        return NULL;
    }
    ev = (EventCore *)o;
    if (ev->seq > s->marked) {
        PyObject *r = PyObject_CallMethodObjArgs(self, s_need, o, NULL);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    } else if (ev->seq > s->awaited) {
        s->awaited = ev->seq; /* marked already, and asked for: keep eager */
    }
    if (completed(s, &c))
        return NULL;
    if (c >= ev->seq) {
        /* Another thread's retire may have taken ev and not yet finished it:
         * only ev->done says its value is there. */
        PyObject *r = stream_retire(self, NULL);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    return PyBool_FromLong(ev->done);
}

/* CudaStream._prune: retire what the markers say has finished (driver events,
 * with event completion, are asked only once 64 operations are in flight: a
 * counter costs a memory read, an event a query), and have the watcher sweep
 * the stream later. */
static int prune(StreamCore *s) {
    Py_ssize_t n = inflight_len(s);
    if (n < 0)
        return -1;
    if (n > 0 && (is_none(s->events) || n >= 64)) {
        EventCore *head = inflight_at(s, 0);
        long long c, first;
        if (head == NULL)
            return -1;
        first = head->seq;
        Py_DECREF(head);
        if (completed(s, &c))
            return -1;
        if (first <= c) {
            PyObject *r = stream_retire((PyObject *)s, NULL);
            if (r == NULL)
                return -1;
            Py_DECREF(r);
        }
    }
    if (!s->touched) {
        PyObject *r;
        s->touched = 1;
        if (sweep_later != NULL) {
            r = PyObject_CallFunctionObjArgs(sweep_later, (PyObject *)s, NULL);
            if (r == NULL)
                return -1;
            Py_DECREF(r);
        }
    }
    return 0;
}

/* _prune_c(): prune above, for a CudaStream's submissions made in Python. */
static PyObject *stream_prune_method(PyObject *self, PyObject *unused) {
    if (prune((StreamCore *)self))
        return NULL;
    Py_RETURN_NONE;
}

/* The data and pointer-array addresses of a _ParamMemory. */
static int param_addrs(PyObject *mem, unsigned long long *addr, unsigned long long *ptrs) {
    PyObject *o = PyObject_GetAttr(mem, s_addr);
    int rc;
    if (o == NULL)
        return -1;
    rc = as_u64(o, addr);
    Py_DECREF(o);
    if (rc)
        return -1;
    o = PyObject_GetAttr(mem, s_pointers);
    if (o == NULL)
        return -1;
    rc = as_u64(o, ptrs);
    Py_DECREF(o);
    return rc;
}

/* Take the stream's submit lock for a submission made in C (and cache the
 * in-flight deque's append where the queue is not an EventQueue): 0, or -1 with
 * an exception. */
static int begin_submit(StreamCore *s, Held *sh) {
    if (!is_queue(s->inflight) &&
        cache_methods(s->inflight, &s->deque_of, &s->append, NULL, s_append, NULL))
        return -1;
    return hold(s->submit_lock, &s->lock_of, &s->acquire, &s->release, sh);
}

/* Give back the lock begin_submit took, then retire what has finished (prune):
 * `ev` (the submission's event, or None: handed back), or NULL with an exception. */
static PyObject *end_submit(StreamCore *s, Held *sh, PyObject *ev) {
    if (unhold(sh))
        Py_CLEAR(ev);
    if (ev == NULL || ev == Py_None)
        return ev;
    if (prune(s)) {
        Py_DECREF(ev);
        return NULL;
    }
    return ev;
}

/* The event of operation `seq` just submitted to `s` (keeping `keep` alive),
 * appended to the stream's in-flight queue: directly to an EventQueue, else
 * through the cached append of the deque. */
static PyObject *new_inflight_event(StreamCore *s, long long seq, PyObject *keep) {
    PyObject *o, *ev = event_new_of(event_type, (PyObject *)s, seq, keep);
    if (ev == NULL)
        return NULL;
    if (is_queue(s->inflight)) {
        if (queue_push((EventQueue *)s->inflight, ev)) {
            Py_DECREF(ev);
            return NULL;
        }
    } else {
        o = PyObject_CallFunctionObjArgs(s->append, ev, NULL);
        if (o == NULL) {
            Py_DECREF(ev);
            return NULL;
        }
        Py_DECREF(o);
    }
    return ev;
}

/* CudaStream._mark: the event of the operation just submitted (under the submit
 * lock, after before_submit and the driver call): the next sequence number, a
 * new event keeping `keep` alive in the in-flight queue, and the marker when
 * the stream is eager (_place_marker). */
static PyObject *mark_submitted(StreamCore *s, PyObject *keep) {
    long long seq = s->seq + 1;
    PyObject *ev;
    s->seq = seq;
    ev = new_inflight_event(s, seq, keep);
    if (ev == NULL)
        return NULL;
    if (s->eager && call_method0((PyObject *)s, s_place_marker)) {
        Py_DECREF(ev);
        return NULL;
    }
    return ev;
}

/* _mark_c(keep): mark_submitted above, for the submissions made in Python. */
static PyObject *stream_mark_method(PyObject *self, PyObject *keep) {
    StreamCore *s = (StreamCore *)self;
    if (event_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "asyncgpu._native: configure() was not called");
        return NULL;
    }
    if (!is_queue(s->inflight) &&
        cache_methods(s->inflight, &s->deque_of, &s->append, NULL, s_append, NULL))
        return NULL;
    return mark_submitted(s, keep);
}

/* Whether a submission made in C may go to the driver now, under the submit
 * lock: 1 (the marker rules applied: before_submit), 0 when the stream is held
 * behind host work (before, or since a marker that before_submit placed was
 * held by another thread: the Python path queues the operation), -1 with an
 * exception. */
static int submit_ready(StreamCore *s) {
    if (!is_none(s->pending))
        return 0;
    if (before_submit(s))
        return -1;
    return is_none(s->pending) ? 1 : 0;
}

/* The launch proper, under the stream's submit lock: a new event, None (the
 * general path takes it), or NULL with an exception. */
static PyObject *launch_locked(StreamCore *s, unsigned long long func, const unsigned long long d[7],
                               PyObject *plan, PyObject *codes, PyObject *argt,
                               PyObject *open_state) {
    PyObject *mem, *ev;
    unsigned long long addr = 0, ptrs = 0;
    long long seq;
    Py_ssize_t nargs = PyTuple_Size(argt);
    int marker, event_marker, err, rc, ready;
    if ((ready = submit_ready(s)) <= 0)
        return ready < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    if (plan == s->mem_plan) {
        addr = s->mem_addr;
        ptrs = s->mem_ptrs;
        rc = 0;
    } else {
        mem = PyDict_GetItemWithError(s->param_mem, plan); /* borrowed */
        if (mem == NULL) {
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_NONE; /* the general path makes the plan's parameter memory */
        }
        Py_INCREF(mem);
        rc = param_addrs(mem, &addr, &ptrs);
        if (rc == 0) {
            Py_INCREF(plan);
            replace_ref(&s->mem_plan, plan);
            Py_INCREF(mem);
            replace_ref(&s->mem_of, mem); /* keeps the addresses valid */
            s->mem_addr = addr;
            s->mem_ptrs = ptrs;
        }
        Py_DECREF(mem);
    }
    if (rc == 0 && nargs)
        rc = pack_args(codes, argt, addr, open_state);
    if (rc)
        return rc < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    seq = s->seq + 1;
    /* The eager marker, or the one every mark_every unmarked operations (written
     * here, right after the launch that is the mark_every-th, rather than by
     * _before_submit before the next one): a driver event where the stream takes
     * them (_kernel_event_markers, with cuEventRecord bound), else the counter,
     * written in the same release of the GIL as the launch. */
    marker = (s->eager || seq - s->marked >= mark_every) && is_none(s->events) && s->caddr;
    event_marker = marker && s->kernel_event_markers && p_record != NULL;
    err = launch_and_mark(func, d, s->h, nargs, ptrs, marker && !event_marker ? s->caddr : 0,
                          (unsigned long long)seq);
    if (err != 0) {
        PyObject *r = PyObject_CallMethod((PyObject *)s, "_launch_failed", "iLO", err, seq, argt);
        Py_XDECREF(r);
        if (r != NULL)
            PyErr_SetString(PyExc_RuntimeError, "asyncgpu: _launch_failed returned");
        return NULL;
    }
    s->seq = seq;
    s->after_copy = 0;
    ev = new_inflight_event(s, seq, argt);
    if (ev == NULL)
        return NULL;
    if (event_marker) {
        if (record_marker(s, seq)) {
            Py_DECREF(ev);
            return NULL; /* the kernel went in (its event is in flight); its marker did not */
        }
        s->marked = s->issued_mark = seq;
    } else if (marker) {
        s->marked = s->issued_mark = s->counter_mark = seq;
    } else if (s->eager && call_method0((PyObject *)s, s_place_marker)) {
        Py_DECREF(ev);
        return NULL;
    }
    return ev;
}

/* launch_fast(stream, func, dims, plan, args) -> DeviceEvent, or None.
 *
 * CudaStream.launch's fast path in one call: under the stream's submit lock,
 * the marker rules of _before_submit, the arguments checked against the plan
 * and packed into the stream's parameter memory for it, cuLaunchKernel (with
 * the counter marker when the stream is eager), the event appended to the
 * stream's in-flight queue; then _prune. None, with nothing launched, when the
 * general path must take the launch: the stream is held, the plan has no
 * parameter memory on this stream yet, or an argument is not the plan's type
 * or cannot be used (the general path raises the precise error).
 */
static PyObject *launch_fast(StreamCore *s, unsigned long long func,
                             const unsigned long long d[7], PyObject *plan, PyObject *argt,
                             PyObject *open_state) {
    PyObject *types, *codes, *ev;
    Held sh;
    int rc;
    if (!is_none(s->pending))
        Py_RETURN_NONE;
    if (!PyTuple_Check(argt)) {
        PyErr_SetString(PyExc_TypeError, "launch: args is a tuple");
        return NULL;
    }
    if (plan == s->plan_of) {
        types = s->plan_types;
        codes = s->plan_codes;
        Py_INCREF(types);
        Py_INCREF(codes);
    } else {
        types = PyObject_GetAttr(plan, s_types);
        if (types == NULL)
            return NULL;
        codes = PyObject_GetAttr(plan, s_codes);
        if (codes == NULL) {
            Py_DECREF(types);
            return NULL;
        }
        Py_INCREF(plan);
        replace_ref(&s->plan_of, plan);
        Py_INCREF(types);
        replace_ref(&s->plan_types, types);
        Py_INCREF(codes);
        replace_ref(&s->plan_codes, codes);
    }
    rc = codes == Py_None ? 1 : plan_matches(types, codes, argt);
    Py_DECREF(types);
    if (rc) {
        Py_DECREF(codes);
        return rc < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    }
    if (begin_submit(s, &sh)) {
        Py_DECREF(codes);
        return NULL;
    }
    ev = launch_locked(s, func, d, plan, codes, argt, open_state);
    Py_DECREF(codes);
    return end_submit(s, &sh, ev);
}

/* CudaStream.launch(fn, args, cfg, constant_memory) -> DeviceEvent, in C. The fast
 * path (launch_fast) when the function has a plan, nothing goes to constant memory
 * and the configuration has plain dimensions; every other launch, and one the fast
 * path hands back, through the stream's _launch. open_state: see usable(). */
static PyObject *stream_launch(PyObject *self, PyObject *const *args, PyObject *open_state) {
    StreamCore *s = (StreamCore *)self;
    PyObject *impl, *plan = NULL, *handle = NULL, *ev = NULL;
    int rc;
    if (is_a(args[0], function_core_type, function_core_seen)) {
        impl = ((FunctionCore *)args[0])->impl;
        if (impl == NULL)
            impl = Py_None;
        Py_INCREF(impl);
    } else {
        impl = PyObject_GetAttr(args[0], s_impl);
        if (impl == NULL)
            return NULL;
    }
    rc = p_launch != NULL && event_type != NULL && impl != Py_None ? PyObject_Not(args[3]) : 0;
    if (rc == 1 && args[2] != s->cfg_of) {
        /* the configuration's plain dimensions, read once per configuration */
        PyObject *dims = PyObject_GetAttr(args[2], s_dims);
        unsigned long long d[7];
        if (dims == NULL) {
            rc = -1;
        } else if (PyTuple_Check(dims) && PyTuple_Size(dims) == 7) {
            if (parse_dims(dims, d)) {
                rc = -1;
            } else {
                Py_INCREF(args[2]);
                replace_ref(&s->cfg_of, args[2]);
                memcpy(s->cfg_dims, d, sizeof d);
            }
        } else {
            rc = 0; /* a cluster, cooperative or priority launch: the general path */
        }
        Py_XDECREF(dims);
    }
    if (rc == 1) {
        unsigned long long func = s->fn_handle;
        if (is_a(impl, kernel_core_type, kernel_core_seen)) {
            plan = ((KernelCore *)impl)->last;
            if (plan == NULL)
                plan = Py_None;
            Py_INCREF(plan);
        } else {
            plan = PyObject_GetAttr(impl, s_last);
        }
        if (impl != s->fn_of) {
            handle = PyObject_GetAttr(impl, s_handle);
            if (handle == NULL || as_u64(handle, &func)) {
                rc = -1;
            } else {
                Py_INCREF(impl);
                replace_ref(&s->fn_of, impl);
                s->fn_handle = func;
            }
        }
        if (rc < 0 || plan == NULL)
            rc = -1;
        else if (plan != Py_None)
            ev = launch_fast(s, func, s->cfg_dims, plan, args[1], open_state);
        if (rc == 1 && ev == NULL && PyErr_Occurred())
            rc = -1;
    }
    Py_XDECREF(plan);
    Py_XDECREF(handle);
    if (rc < 0) {
        Py_DECREF(impl);
        return NULL;
    }
    if (ev != NULL && ev != Py_None) {
        Py_DECREF(impl);
        return ev;
    }
    Py_XDECREF(ev);
    ev = PyObject_CallMethodObjArgs(self, s_launch_general, args[0], impl, args[1], args[2],
                                    args[3], NULL);
    Py_DECREF(impl);
    return ev;
}

/* StreamCore._launch_c(fn, args, cfg, constant_memory): stream_launch, packing
 * buffers of the stream's own context only (a launch reaches it from
 * enqueue_function's general path, which has found that context open). */
static PyObject *stream_launch_method(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    PyObject *state = ((StreamCore *)self)->state;
    if (n != 4) {
        PyErr_SetString(PyExc_TypeError, "launch(fn, args, cfg, constant_memory)");
        return NULL;
    }
    return stream_launch(self, args, state == Py_None ? NULL : state);
}

/* The copy proper, under the stream's submit lock: a new event, None (the
 * stream is held: the Python path queues the copy), or NULL with an exception. */
static PyObject *copy_locked(StreamCore *s, unsigned long long dst, unsigned long long src,
                             unsigned long long nbytes, PyObject *keep) {
    int err = 0, ready;
    if ((ready = submit_ready(s)) <= 0)
        return ready < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    if (nbytes) {
        /* The GIL is released as cuda.bindings does: a copy can wait for room in
         * the device's queue, and a pool thread may need the GIL meanwhile. */
        Py_BEGIN_ALLOW_THREADS
        err = p_memcpy(dst, src, (size_t)nbytes, (void *)(uintptr_t)s->h);
        Py_END_ALLOW_THREADS
        if (err != 0) {
            PyObject *r = PyObject_CallMethod((PyObject *)s, "_driver_error", "is", err,
                                              "cuMemcpyAsync");
            Py_XDECREF(r);
            if (r != NULL)
                PyErr_SetString(PyExc_RuntimeError, "asyncgpu: _driver_error returned");
            return NULL;
        }
        s->after_copy = 1; /* its marker is a driver event (_place_marker) */
    }
    return mark_submitted(s, keep);
}

/* StreamCore._copy_c(dst, src, nbytes, keep) -> DeviceEvent, or None.
 *
 * CudaStream.copy for device and page-locked memory in one call: under the
 * stream's submit lock, the marker rules of _before_submit, cuMemcpyAsync, the
 * event (keeping `keep` alive) appended to the stream's in-flight queue, the
 * marker when the stream is eager; then _prune. None, with nothing submitted,
 * when cuMemcpyAsync is not bound or the stream is held behind host work. */
static PyObject *stream_copy_method(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    StreamCore *s = (StreamCore *)self;
    unsigned long long dst, src, nbytes;
    Held sh;
    if (n != 4) {
        PyErr_SetString(PyExc_TypeError, "_copy_c(dst, src, nbytes, keep)");
        return NULL;
    }
    if (p_memcpy == NULL || event_type == NULL || !is_none(s->pending))
        Py_RETURN_NONE;
    if (as_u64(args[0], &dst) || as_u64(args[1], &src) || as_u64(args[2], &nbytes))
        return NULL;
    if (begin_submit(s, &sh))
        return NULL;
    return end_submit(s, &sh, copy_locked(s, dst, src, nbytes, args[3]));
}

/* The graph launch proper, under the stream's submit lock: a new event, None
 * (the Python path takes it), or NULL with an exception. The graph's lock is
 * taken after the submit lock, as the Python path and a held launch take it. */
static PyObject *graph_locked(StreamCore *s, unsigned long long exe, RLockObject *lock,
                              PyObject *applied, PyObject *want, PyObject *keep) {
    int err = 0, ready;
    if ((ready = submit_ready(s)) <= 0)
        return ready < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    if (rlock_take(lock, 1, -1) != 1) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "asyncgpu: a lock was not taken");
        return NULL;
    }
    if (PyList_GetItem(applied, 0) != want) {
        /* An update changed the graph's parameters since this replay took its own:
         * the Python path sets them again first. */
        if (rlock_give(lock))
            return NULL;
        Py_RETURN_NONE;
    }
    /* The GIL is released as cuda.bindings does: a launch can wait for room in the
     * device's queue, and a pool thread may need the GIL meanwhile. */
    Py_BEGIN_ALLOW_THREADS
    err = p_graph_launch((void *)(uintptr_t)exe, (void *)(uintptr_t)s->h);
    Py_END_ALLOW_THREADS
    if (rlock_give(lock))
        return NULL;
    if (err != 0) {
        PyObject *r = PyObject_CallMethod((PyObject *)s, "_driver_error", "is", err,
                                          "cuGraphLaunch");
        Py_XDECREF(r);
        if (r != NULL)
            PyErr_SetString(PyExc_RuntimeError, "asyncgpu: _driver_error returned");
        return NULL;
    }
    s->after_copy = 0;
    return mark_submitted(s, keep);
}

/* StreamCore._graph_c(exe, lock, applied, want, keep) -> DeviceEvent, or None.
 *
 * CudaStream.graph_launch in one call: under the stream's submit lock, the
 * marker rules of _before_submit, then under the graph's lock (an RLock of this
 * extension) cuGraphLaunch of the CUgraphExec `exe` (an int), the event
 * (keeping `keep` alive) appended to the stream's in-flight queue, the marker
 * when the stream is eager; then _prune. The launch is made only while
 * applied[0] (a list: the parameters the driver graph holds) is `want` (the
 * replay's). None, with nothing submitted, when cuGraphLaunch is not bound, the
 * stream is held behind host work, or the parameters differ. */
static PyObject *stream_graph_method(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    StreamCore *s = (StreamCore *)self;
    unsigned long long exe;
    Held sh;
    if (n != 5) {
        PyErr_SetString(PyExc_TypeError, "_graph_c(exe, lock, applied, want, keep)");
        return NULL;
    }
    if (p_graph_launch == NULL || event_type == NULL || !is_none(s->pending))
        Py_RETURN_NONE;
    if (Py_TYPE(args[1]) != rlock_type || !PyList_Check(args[2]) || PyList_Size(args[2]) != 1) {
        PyErr_SetString(PyExc_TypeError,
                        "_graph_c: lock must be an asyncgpu._native.RLock, applied a list of one");
        return NULL;
    }
    if (as_u64(args[0], &exe))
        return NULL;
    if (begin_submit(s, &sh))
        return NULL;
    return end_submit(s, &sh,
                      graph_locked(s, exe, (RLockObject *)args[1], args[2], args[3], args[4]));
}

/* ---------------------------------------------------------------------------------
 * SpareCore: the device buffers one stream keeps for its next allocation of the
 * same size (asyncgpu._devices.cuda.memory._SpareBuffers subclasses it; the rules are documented
 * there), in a small table of sizes: no Python object is made or looked up to
 * keep or take one. take and keep run no Python code between looking and
 * changing, so the GIL makes them atomic: a buffer's finalizer may keep memory
 * from any thread, even while this thread is inside a take (garbage collection).
 */
static PyObject *s_alloc_ptr; /* "ptr" (set at module init) */
#define SPARE_SIZES 16   /* sizes kept at once (the module exports it: memory.py reads it) */
#define SPARE_PER_SIZE 8 /* the most per_size may be */

typedef struct {
    Py_ssize_t nbytes; /* 0: a free row */
    int count;
    PyObject *alloc[SPARE_PER_SIZE]; /* newest last */
    unsigned long long ptr[SPARE_PER_SIZE]; /* their addresses; 0: read alloc.ptr */
} SpareRow;

typedef struct {
    PyObject_HEAD
    long long room, per_size;
    char closed;
    SpareRow rows[SPARE_SIZES];
} SpareCore;

static PyTypeObject *spare_core_type = NULL;

/* A kept allocation of nbytes (a new reference; *ptr its address, or 0 when
 * the keeper did not say), or NULL: none kept. Sets no exception. */
static PyObject *spare_take(SpareCore *sp, Py_ssize_t nbytes, unsigned long long *ptr) {
    int i;
    for (i = 0; i < SPARE_SIZES; i++) {
        SpareRow *r = &sp->rows[i];
        if (r->nbytes == nbytes && r->count > 0) {
            PyObject *a = r->alloc[--r->count];
            r->alloc[r->count] = NULL;
            *ptr = r->ptr[r->count];
            if (r->count == 0)
                r->nbytes = 0;
            sp->room += nbytes;
            return a; /* the row's reference */
        }
    }
    return NULL;
}

/* Keep the allocation a of nbytes at address ptr (0: unknown): 1 kept, 0 not
 * (closed, no room, as many of that size as it keeps, or as many sizes). */
static int spare_keep(SpareCore *sp, PyObject *a, Py_ssize_t nbytes, unsigned long long ptr) {
    SpareRow *row = NULL;
    int i;
    if (sp->closed || nbytes <= 0 || nbytes > sp->room)
        return 0;
    for (i = 0; i < SPARE_SIZES; i++) {
        SpareRow *r = &sp->rows[i];
        if (r->nbytes == nbytes) {
            row = r;
            break;
        }
        if (r->nbytes == 0 && row == NULL)
            row = r;
    }
    if (row == NULL || row->count >= sp->per_size)
        return 0;
    row->nbytes = nbytes;
    Py_INCREF(a);
    row->alloc[row->count] = a;
    row->ptr[row->count] = ptr;
    row->count++;
    sp->room -= nbytes;
    return 1;
}

static int as_nbytes(PyObject *o, Py_ssize_t *out) {
    Py_ssize_t v = PyLong_AsSsize_t(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* take(nbytes) -> allocation | None */
static PyObject *spare_take_method(PyObject *self, PyObject *arg) {
    Py_ssize_t nbytes;
    unsigned long long ptr;
    PyObject *a;
    if (as_nbytes(arg, &nbytes))
        return NULL;
    a = spare_take((SpareCore *)self, nbytes, &ptr);
    if (a == NULL)
        Py_RETURN_NONE;
    return a;
}

/* keep(allocation, nbytes) -> bool. The allocation's address is its ptr, where
 * it has an int one (a _DeviceAlloc), else unknown (0). */
static PyObject *spare_keep_method(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    Py_ssize_t nbytes;
    unsigned long long ptr = 0;
    PyObject *o;
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "keep(allocation, nbytes)");
        return NULL;
    }
    if (as_nbytes(args[1], &nbytes))
        return NULL;
    o = PyObject_GetAttr(args[0], s_alloc_ptr);
    if (o == NULL || !PyLong_Check(o) || as_u64(o, &ptr))
        ptr = 0;
    Py_XDECREF(o);
    PyErr_Clear();
    return PyBool_FromLong(spare_keep((SpareCore *)self, args[0], nbytes, ptr));
}

/* _take_all(close) -> [allocation, ...]: every kept allocation, now no longer
 * kept (the room is whole again); with close, none is kept from now on. */
static PyObject *spare_take_all(PyObject *self, PyObject *close) {
    SpareCore *sp = (SpareCore *)self;
    PyObject *all = PyList_New(0);
    int c = PyObject_IsTrue(close), i;
    if (all == NULL || c < 0) {
        Py_XDECREF(all);
        return NULL;
    }
    if (c)
        sp->closed = 1;
    for (i = 0; i < SPARE_SIZES; i++) {
        SpareRow *r = &sp->rows[i];
        while (r->count > 0) {
            PyObject *a = r->alloc[r->count - 1];
            if (PyList_Append(all, a)) {
                Py_DECREF(all);
                return NULL;
            }
            r->alloc[--r->count] = NULL;
            Py_DECREF(a); /* the list holds it */
            sp->room += r->nbytes;
        }
        r->nbytes = 0;
    }
    return all;
}

/* bufs -> {nbytes: [allocation, ...]}: what is kept, newest last (a copy). */
static PyObject *spare_get_bufs(PyObject *self, void *closure) {
    SpareCore *sp = (SpareCore *)self;
    PyObject *d = PyDict_New();
    int i, j;
    if (d == NULL)
        return NULL;
    for (i = 0; i < SPARE_SIZES; i++) {
        SpareRow *r = &sp->rows[i];
        PyObject *key, *list;
        if (r->count == 0)
            continue;
        key = PyLong_FromSsize_t(r->nbytes);
        list = PyList_New(r->count);
        if (key == NULL || list == NULL || PyDict_SetItem(d, key, list)) {
            Py_XDECREF(key);
            Py_XDECREF(list);
            Py_DECREF(d);
            return NULL;
        }
        for (j = 0; j < r->count; j++) {
            Py_INCREF(r->alloc[j]);
            PyList_SetItem(list, j, r->alloc[j]);
        }
        Py_DECREF(key);
        Py_DECREF(list);
    }
    return d;
}

static PyObject *spare_tp_new(PyTypeObject *tp, PyObject *args, PyObject *kwds) {
    static char *names[] = {"room", "per_size", NULL};
    long long room, per_size;
    SpareCore *sp;
    allocfunc alloc;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LL:SpareCore", names, &room, &per_size))
        return NULL;
    if (per_size < 0 || per_size > SPARE_PER_SIZE || room < 0) {
        PyErr_Format(PyExc_ValueError, "SpareCore: per_size is 0 to %d, room not negative",
                     SPARE_PER_SIZE);
        return NULL;
    }
    alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
    sp = (SpareCore *)alloc(tp, 0); /* zeroed: every row free */
    if (sp == NULL)
        return NULL;
    sp->room = room;
    sp->per_size = per_size;
    return (PyObject *)sp;
}

static int spare_traverse(PyObject *self, visitproc visit, void *arg) {
    SpareCore *sp = (SpareCore *)self;
    int i, j;
    Py_VISIT(Py_TYPE(self));
    for (i = 0; i < SPARE_SIZES; i++)
        for (j = 0; j < sp->rows[i].count; j++)
            Py_VISIT(sp->rows[i].alloc[j]);
    return 0;
}

static int spare_clear(PyObject *self) {
    SpareCore *sp = (SpareCore *)self;
    int i;
    for (i = 0; i < SPARE_SIZES; i++) {
        SpareRow *r = &sp->rows[i];
        while (r->count > 0) {
            PyObject *a = r->alloc[--r->count];
            r->alloc[r->count] = NULL;
            Py_DECREF(a);
        }
        r->nbytes = 0;
    }
    return 0;
}

static void spare_dealloc(PyObject *self) { dealloc_core(self, spare_clear); }

static PyMemberDef spare_members[] = {
    {"room", T_LONGLONG, offsetof(SpareCore, room), 0, NULL},
    {"per_size", T_LONGLONG, offsetof(SpareCore, per_size), READONLY, NULL},
    {"closed", T_BOOL, offsetof(SpareCore, closed), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef spare_getset[] = {
    {"bufs", spare_get_bufs, NULL, "{nbytes: [allocation, ...]}: what is kept (a copy).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef spare_methods[] = {
    {"take", spare_take_method, METH_O, "take(nbytes) -> a kept allocation of nbytes, or None."},
    {"keep", (PyCFunction)(void (*)(void))spare_keep_method, METH_FASTCALL,
     "keep(allocation, nbytes) -> bool: whether it is kept (room, per size, not closed)."},
    {"_take_all", spare_take_all, METH_O,
     "_take_all(close) -> every kept allocation, no longer kept; with close, keep none "
     "from now on."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot spare_slots[] = {
    {Py_tp_new, (void *)spare_tp_new},
    {Py_tp_methods, spare_methods},
    {Py_tp_members, spare_members},
    {Py_tp_getset, spare_getset},
    {Py_tp_traverse, (void *)spare_traverse},
    {Py_tp_clear, (void *)spare_clear},
    {Py_tp_dealloc, (void *)spare_dealloc},
    {Py_tp_doc, "SpareCore(room, per_size): the device buffers a stream keeps "
                "(asyncgpu._devices.cuda.memory._SpareBuffers subclasses this)."},
    {0, NULL},
};

static PyType_Spec spare_spec = {
    "asyncgpu._native.SpareCore", sizeof(SpareCore), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, spare_slots,
};

/* Set by configure_buffers(): asyncgpu's DeviceBuffer and DeviceFunction classes,
 * the CUDA backend's _DeviceAlloc and CudaStream classes (configure()), _buffer's
 * as_dtype, and numpy.dtype. */
static PyTypeObject *device_buffer_type = NULL, *device_alloc_type = NULL,
                    *function_type = NULL, *cuda_stream_type = NULL, *np_dtype_type = NULL;
static PyObject *as_dtype_fn = NULL;
static PyObject *dtype_cache = NULL; /* {dtype argument: (dtype, itemsize)} */
/* the last hit of dtype_cache: the argument object and its entry (a dtype
 * argument passed again and again is found without hashing) */
static PyObject *dtype_last_key = NULL, *dtype_last_entry = NULL;
static int exiting = 0;              /* the interpreter is exiting (set_exiting()) */
#define DTYPE_CACHE_MAX 256
static PyObject *s_release_memory, *s_open, *s_trace, *s_grid_dim, *s_block_dim,
    *s_launch, *s_alloc_ptr, *s_itemsize, *s_general_function, *s_general_create, *empty_tuple,
    *s_alloc_device, *s_backend, *s_record, *s_kernel, *s_name;

/* A dropped buffer that owns memory: a device allocation of a CUDA stream goes
 * back to the stream's kept buffers here, without Python, when the stream keeps
 * it; everything else through the buffer's _release_memory (the frees, and what
 * happens once the interpreter exits). A finalizer has nobody to raise to:
 * _release_memory swallows errors, and what still escapes is reported as
 * unraisable. */
static void buffer_finalize(PyObject *self) {
    BufferCore *b = (BufferCore *)self;
    PyObject *et, *ev, *tb, *r;
    if (!b->owns || is_none(b->alloc))
        return;
    if (!exiting && device_alloc_type != NULL && Py_TYPE(b->alloc) == device_alloc_type &&
        b->nbytes > 0 && b->owner != NULL && is_a(b->owner, stream_core_type, stream_core_seen)) {
        PyObject *sp = ((StreamCore *)b->owner)->spare;
        /* (spare_keep sets no exception and runs no Python code; the buffer
         * keeps its reference to the allocation until the Py_CLEAR, whose
         * decref cannot free it: the stream's kept buffers hold it now) */
        if (sp != NULL && is_a(sp, spare_core_type, spare_core_seen) &&
            spare_keep((SpareCore *)sp, b->alloc, b->nbytes, b->ptr)) {
            Py_CLEAR(b->alloc);
            return;
        }
    }
    PyErr_Fetch(&et, &ev, &tb);
    r = PyObject_CallMethodObjArgs(self, s_release_memory, NULL);
    if (r == NULL)
        PyErr_WriteUnraisable(self);
    else
        Py_DECREF(r);
    PyErr_Restore(et, ev, tb);
}

/* KernelCore (typedef above). */
static PyMemberDef kernel_members[] = {
    {"last", T_OBJECT, offsetof(KernelCore, last), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static int kernel_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(((KernelCore *)self)->last);
    return 0;
}

static int kernel_clear(PyObject *self) {
    Py_CLEAR(((KernelCore *)self)->last);
    return 0;
}

static void kernel_dealloc(PyObject *self) { dealloc_core(self, kernel_clear); }

static PyType_Slot kernel_slots[] = {
    {Py_tp_members, kernel_members},
    {Py_tp_traverse, (void *)kernel_traverse},
    {Py_tp_clear, (void *)kernel_clear},
    {Py_tp_dealloc, (void *)kernel_dealloc},
    {Py_tp_doc, "The field of a compiled CUDA function that every launch reads: the "
                "argument plan of its last launch (asyncgpu._devices.cuda.launch._CudaFunction "
                "subclasses this)."},
    {0, NULL},
};

static PyType_Spec kernel_spec = {
    "asyncgpu._native.KernelCore", sizeof(KernelCore), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, kernel_slots,
};

/* StateCore and RefCore (typedefs above). */
static PyMemberDef state_members[] = {
    {"closed", T_BOOL, offsetof(StateCore, closed), 0, NULL},
    {"trace", T_OBJECT, offsetof(StateCore, trace), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static int state_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(((StateCore *)self)->trace);
    return 0;
}

static int state_clear(PyObject *self) {
    Py_CLEAR(((StateCore *)self)->trace);
    return 0;
}

static void state_dealloc(PyObject *self) { dealloc_core(self, state_clear); }

static PyType_Slot state_slots[] = {
    {Py_tp_members, state_members},
    {Py_tp_traverse, (void *)state_traverse},
    {Py_tp_clear, (void *)state_clear},
    {Py_tp_dealloc, (void *)state_dealloc},
    {Py_tp_doc, "The fields of a context's state that every enqueue reads (asyncgpu._context "
                "subclasses this)."},
    {0, NULL},
};

static PyType_Spec state_spec = {
    "asyncgpu._native.StateCore", sizeof(StateCore), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, state_slots,
};

static PyMemberDef ref_members[] = {
    {"open", T_BOOL, offsetof(RefCore, open), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static void ref_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    freefunc free_ = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    free_(self);
    Py_DECREF(tp);
}

static PyType_Slot ref_slots[] = {
    {Py_tp_members, ref_members},
    {Py_tp_dealloc, (void *)ref_dealloc},
    {Py_tp_doc, "Whether one reference to a context is open (asyncgpu._context subclasses this)."},
    {0, NULL},
};

static PyType_Spec ref_spec = {
    "asyncgpu._native.RefCore", sizeof(RefCore), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    ref_slots,
};

/* FunctionCore (typedef above): DeviceFunction's fields. */
static PyMemberDef function_members[] = {
    {"_ctx", T_OBJECT, offsetof(FunctionCore, ctx), 0, NULL},
    {"_impl", T_OBJECT, offsetof(FunctionCore, impl), 0, NULL},
    {"_cfgs", T_OBJECT, offsetof(FunctionCore, cfgs), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static int function_traverse(PyObject *self, visitproc visit, void *arg) {
    FunctionCore *f = (FunctionCore *)self;
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(f->ctx);
    Py_VISIT(f->impl);
    Py_VISIT(f->cfgs);
    Py_VISIT(f->grid_of);
    Py_VISIT(f->block_of);
    Py_VISIT(f->cfg_of);
    return 0;
}

static int function_clear(PyObject *self) {
    FunctionCore *f = (FunctionCore *)self;
    Py_CLEAR(f->ctx);
    Py_CLEAR(f->impl);
    Py_CLEAR(f->cfgs);
    Py_CLEAR(f->grid_of);
    Py_CLEAR(f->block_of);
    Py_CLEAR(f->cfg_of);
    return 0;
}

static void function_dealloc(PyObject *self) { dealloc_core(self, function_clear); }

static PyType_Slot function_slots[] = {
    {Py_tp_members, function_members},
    {Py_tp_traverse, (void *)function_traverse},
    {Py_tp_clear, (void *)function_clear},
    {Py_tp_dealloc, (void *)function_dealloc},
    {Py_tp_doc, "The fields of a DeviceFunction that a launch reads (asyncgpu._function "
                "subclasses this)."},
    {0, NULL},
};

static PyType_Spec function_spec = {
    "asyncgpu._native.FunctionCore", sizeof(FunctionCore), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, function_slots,
};

/* ---------------------------------------------------------------------------------
 * ContextCore: the fields of a DeviceContext (asyncgpu._context.DeviceContext
 * subclasses it), and the two calls users make thousands of times a second in C:
 * enqueue_function and enqueue_create_buffer. Each takes the common case itself
 * and hands every other call, unchanged, to the Python method it stands in for
 * (DeviceContext._enqueue_function, ._enqueue_create_buffer), which does the
 * checks and raises the precise errors.
 */
static PyMemberDef context_members[] = {
    {"_state", T_OBJECT, offsetof(ContextCore, state), 0, NULL},
    {"_impl", T_OBJECT, offsetof(ContextCore, impl), 0, NULL},
    {"_ref", T_OBJECT, offsetof(ContextCore, ref), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static int context_traverse(PyObject *self, visitproc visit, void *arg) {
    ContextCore *c = (ContextCore *)self;
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(c->state);
    Py_VISIT(c->impl);
    Py_VISIT(c->ref);
    return 0;
}

static int context_clear(PyObject *self) {
    ContextCore *c = (ContextCore *)self;
    Py_CLEAR(c->state);
    Py_CLEAR(c->impl);
    Py_CLEAR(c->ref);
    return 0;
}

static void context_dealloc(PyObject *self) { dealloc_core(self, context_clear); }

/* 1 when the context is open (state.closed is False and ref.open True), 0 when
 * not (the general path raises), -1 on error. */
static int context_open(ContextCore *c) {
    PyObject *o;
    int rc;
    if (c->state == NULL || c->ref == NULL || c->impl == NULL)
        return 0;
    rc = state_closed(c->state);
    if (rc != 0)
        return rc < 0 ? -1 : 0;
    if (is_a(c->ref, ref_core_type, ref_core_seen))
        return ((RefCore *)c->ref)->open;
    o = PyObject_GetAttr(c->ref, s_open);
    if (o == NULL)
        return -1;
    rc = PyObject_IsTrue(o);
    Py_DECREF(o);
    return rc;
}

/* 1 when the state records no trace, 0 when it does, -1 on error. */
static int untraced(PyObject *state) {
    PyObject *o;
    int rc;
    if (is_a(state, state_core_type, state_core_seen))
        return is_none(((StateCore *)state)->trace);
    o = PyObject_GetAttr(state, s_trace);
    if (o == NULL)
        return -1;
    rc = o == Py_None;
    Py_DECREF(o);
    return rc;
}

/* While tracing: the trace of `state` records the launch `ev` of the function
 * `fn` (Trace.record(impl, ev, "kernel", fn.name), as the general path does).
 * 0, or -1 with an exception. */
static int trace_launch(PyObject *state, PyObject *impl, PyObject *fn, PyObject *ev) {
    PyObject *trace, *name, *r;
    if (is_a(state, state_core_type, state_core_seen)) {
        trace = ((StateCore *)state)->trace;
        Py_XINCREF(trace);
    } else {
        trace = PyObject_GetAttr(state, s_trace);
    }
    if (trace == NULL)
        return -1;
    if (trace == Py_None) { /* (no longer tracing: another thread ended it) */
        Py_DECREF(trace);
        return 0;
    }
    name = PyObject_GetAttr(fn, s_name);
    r = name == NULL ? NULL : PyObject_CallMethodObjArgs(trace, s_record, impl, ev, s_kernel, name, NULL);
    Py_XDECREF(name);
    Py_DECREF(trace);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* The Python method `name` of self, called with the same arguments. */
static PyObject *call_general(PyObject *self, PyObject *name, PyObject *const *args,
                              Py_ssize_t n, PyObject *kwnames) {
    PyObject *meth, *t, *kw = NULL, *r = NULL;
    Py_ssize_t i, nk = kwnames == NULL ? 0 : PyTuple_Size(kwnames);
    meth = PyObject_GetAttr(self, name);
    if (meth == NULL)
        return NULL;
    t = PyTuple_New(n);
    if (t == NULL)
        goto done;
    for (i = 0; i < n; i++) {
        Py_INCREF(args[i]);
        PyTuple_SetItem(t, i, args[i]);
    }
    if (nk > 0) {
        kw = PyDict_New();
        if (kw == NULL)
            goto done;
        for (i = 0; i < nk; i++)
            if (PyDict_SetItem(kw, PyTuple_GetItem(kwnames, i), args[n + i]))
                goto done;
    }
    r = PyObject_Call(meth, t, kw);
done:
    Py_DECREF(meth);
    Py_XDECREF(t);
    Py_XDECREF(kw);
    return r;
}

/* A launch dimension the fast path takes: an int, or a tuple of ints (exactly
 * those types: a bool, a float or a NumPy integer goes to the general path,
 * which validates it). */
static int plain_dims(PyObject *v) {
    Py_ssize_t i, n;
    if (PyLong_CheckExact(v))
        return 1;
    if (!PyTuple_CheckExact(v))
        return 0;
    n = PyTuple_Size(v);
    for (i = 0; i < n; i++)
        if (!PyLong_CheckExact(PyTuple_GetItem(v, i)))
            return 0;
    return 1;
}

static int same_name(PyObject *a, PyObject *b) {
    return a == b || (PyUnicode_Check(a) && PyUnicode_Compare(a, b) == 0);
}

/* Whether two launch dimensions the fast path takes (plain_dims) are equal. */
static int same_dims(PyObject *a, PyObject *b) {
    Py_ssize_t i, n;
    if (a == b)
        return 1;
    if (a == NULL || b == NULL)
        return 0;
    if (PyLong_CheckExact(a) && PyLong_CheckExact(b)) {
        int overflow_a, overflow_b;
        long long x = PyLong_AsLongLongAndOverflow(a, &overflow_a);
        long long y = PyLong_AsLongLongAndOverflow(b, &overflow_b);
        if ((x == -1 || y == -1) && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        return !overflow_a && !overflow_b && x == y;
    }
    if (!PyTuple_CheckExact(a) || !PyTuple_CheckExact(b) || (n = PyTuple_Size(a)) != PyTuple_Size(b))
        return 0;
    for (i = 0; i < n; i++)
        if (!same_dims(PyTuple_GetItem(a, i), PyTuple_GetItem(b, i)))
            return 0;
    return 1;
}

/* The key of a launch configuration in a function's cache (f._cfgs): the only
 * place it is built (launch_key below is DeviceContext._enqueue_function's).
 * attributes: a sequence of hashable launch attributes. A new reference, or NULL
 * with an exception. */
static PyObject *make_launch_key(PyObject *grid, PyObject *block, PyObject *cluster,
                                 PyObject *shmem, PyObject *attributes) {
    PyObject *attrs, *key;
    if (PyTuple_CheckExact(attributes)) {
        Py_INCREF(attributes);
        attrs = attributes;
    } else {
        attrs = PySequence_Tuple(attributes);
        if (attrs == NULL)
            return NULL;
    }
    key = PyTuple_Pack(5, grid, block, cluster, shmem, attrs);
    Py_DECREF(attrs);
    return key;
}

/* launch_key(grid, block, cluster, shared_mem, attributes) -> the key of a
 * launch configuration in DeviceFunction._cfgs (make_launch_key). */
static PyObject *launch_key(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "launch_key(grid, block, cluster, shared_mem, attributes)");
        return NULL;
    }
    return make_launch_key(args[0], args[1], args[2], args[3], args[4]);
}

/* The cached launch configuration of f for (grid, block), validated by an
 * earlier general call (a new reference), or NULL: none yet (no exception set)
 * or an error. The last one looked up is kept on f: an entry of f._cfgs never
 * changes once made. */
static PyObject *cached_config(FunctionCore *f, PyObject *grid, PyObject *block) {
    PyObject *key, *cfg;
    if (f->cfg_of != NULL && same_dims(grid, f->grid_of) && same_dims(block, f->block_of)) {
        Py_INCREF(f->cfg_of);
        return f->cfg_of;
    }
    if (f->cfgs == NULL || !PyDict_Check(f->cfgs))
        return NULL;
    key = make_launch_key(grid, block, Py_None, Py_None, empty_tuple);
    if (key == NULL)
        return NULL;
    cfg = PyDict_GetItemWithError(f->cfgs, key); /* borrowed */
    Py_DECREF(key);
    if (cfg == NULL)
        return NULL;
    Py_INCREF(grid);
    replace_ref(&f->grid_of, grid);
    Py_INCREF(block);
    replace_ref(&f->block_of, block);
    Py_INCREF(cfg);
    replace_ref(&f->cfg_of, cfg);
    Py_INCREF(cfg);
    return cfg;
}

/* enqueue_function's fast path: a new event, Py_None (a new reference: the
 * general path takes the call), or NULL with an exception. It takes a
 * DeviceFunction of this context launched with grid_dim and block_dim alone
 * (ints or tuples of ints), whose launch configuration for them is cached.
 * While tracing, the trace records the launch after it (trace_launch). */
static PyObject *function_fast(ContextCore *c, PyObject *const *args, Py_ssize_t n,
                               PyObject *kwnames) {
    PyObject *grid = NULL, *block = NULL, *cfg, *argt, *ev;
    FunctionCore *f;
    Py_ssize_t i;
    int rc, traced;
    if (n < 1 || kwnames == NULL || function_type == NULL || PyTuple_Size(kwnames) != 2)
        Py_RETURN_NONE;
    for (i = 0; i < 2; i++) {
        PyObject *name = PyTuple_GetItem(kwnames, i);
        if (name == s_grid_dim || (name != s_block_dim && same_name(name, s_grid_dim)))
            grid = args[n + i];
        else if (same_name(name, s_block_dim))
            block = args[n + i];
    }
    f = (FunctionCore *)args[0];
    if (grid == NULL || block == NULL || Py_TYPE(args[0]) != function_type ||
        !plain_dims(grid) || !plain_dims(block))
        Py_RETURN_NONE;
    rc = context_open(c);
    if (rc <= 0)
        return rc < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    /* compiled for this context */
    if (f->ctx == NULL || !is_a(f->ctx, context_core_type, context_core_seen) ||
        ((ContextCore *)f->ctx)->state != c->state)
        Py_RETURN_NONE;
    rc = untraced(c->state);
    if (rc < 0)
        return NULL;
    traced = rc == 0;
    cfg = cached_config(f, grid, block);
    if (cfg == NULL)
        return PyErr_Occurred() ? NULL : (Py_INCREF(Py_None), Py_None);
    argt = PyTuple_New(n - 1);
    if (argt == NULL) {
        Py_DECREF(cfg);
        return NULL;
    }
    for (i = 1; i < n; i++) {
        Py_INCREF(args[i]);
        PyTuple_SetItem(argt, i - 1, args[i]);
    }
    if (cuda_stream_type != NULL && Py_TYPE(c->impl) == cuda_stream_type) {
        PyObject *la[4];
        la[0] = args[0];
        la[1] = argt;
        la[2] = cfg;
        la[3] = empty_tuple;
        ev = stream_launch(c->impl, la, c->state);
    } else {
        ev = PyObject_CallMethodObjArgs(c->impl, s_launch, args[0], argt, cfg, empty_tuple, NULL);
    }
    Py_DECREF(argt);
    Py_DECREF(cfg);
    if (traced && ev != NULL && trace_launch(c->state, c->impl, args[0], ev) < 0)
        Py_CLEAR(ev);
    return ev;
}

/* DeviceContext.enqueue_function (its general path: _enqueue_function). */
static PyObject *context_enqueue_function(PyObject *self, PyObject *const *args, Py_ssize_t n,
                                          PyObject *kwnames) {
    PyObject *ev = function_fast((ContextCore *)self, args, n, kwnames);
    if (ev != Py_None)
        return ev;
    Py_DECREF(ev);
    return call_general(self, s_general_function, args, n, kwnames);
}

/* (dtype, itemsize) of a dtype argument (borrowed, from the cache), or NULL:
 * not one the cache takes (no exception set) or an error (set). The cache keeps
 * what as_dtype made of types and strings; a NumPy dtype stands for itself. */
static PyObject *cached_dtype(PyObject *key) {
    PyObject *entry, *dt, *size;
    int is_dtype;
    if (key == dtype_last_key && key != NULL)
        return dtype_last_entry; /* the same object as the last call's */
    is_dtype = np_dtype_type != NULL && PyObject_TypeCheck(key, np_dtype_type);
    if (dtype_cache == NULL || as_dtype_fn == NULL ||
        !(is_dtype || PyType_Check(key) || PyUnicode_CheckExact(key)))
        return NULL;
    entry = PyDict_GetItemWithError(dtype_cache, key);
    if (entry != NULL) {
        /* equal dtypes may differ (metadata): only the same object is a hit */
        if (is_dtype && PyTuple_GetItem(entry, 0) != key)
            return NULL;
        Py_INCREF(key);
        replace_ref(&dtype_last_key, key);
        Py_INCREF(entry);
        replace_ref(&dtype_last_entry, entry);
        return entry;
    }
    if (PyErr_Occurred() || PyDict_Size(dtype_cache) >= DTYPE_CACHE_MAX)
        return NULL; /* (full: the general path) */
    dt = PyObject_CallFunctionObjArgs(as_dtype_fn, key, NULL); /* raises for a bad dtype */
    if (dt == NULL)
        return NULL;
    size = PyObject_GetAttr(dt, s_itemsize);
    entry = size == NULL ? NULL : PyTuple_Pack(2, dt, size);
    Py_DECREF(dt);
    Py_XDECREF(size);
    if (entry == NULL || PyDict_SetItem(dtype_cache, key, entry)) {
        Py_XDECREF(entry);
        return NULL;
    }
    Py_DECREF(entry); /* borrowed from here on: the cache holds it */
    return entry;
}

/* A new allocation of n bytes (a Python int) for stream s, made as a
 * submission: under the stream's submit lock, refused once close() has begun
 * (the flag close() sets under that lock), from the backend
 * (state.backend.alloc_device(n, s): cuMemAllocFromPoolAsync, in Python). The
 * one implementation of _PolledStream.alloc_device (its _alloc_device_c) and of
 * the compiled enqueue_create_buffer's new allocations. NULL with an exception
 * (out of memory: DeviceError; closing: ContextClosedError). */
static PyObject *stream_alloc(StreamCore *s, PyObject *n) {
    PyObject *backend, *a = NULL;
    Held sh;
    if (s->state == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "asyncgpu: the stream is not initialised");
        return NULL;
    }
    backend = PyObject_GetAttr(s->state, s_backend);
    if (backend == NULL)
        return NULL;
    if (hold(s->submit_lock, &s->lock_of, &s->acquire, &s->release, &sh) == 0) {
        if (s->closing) {
            if (call_method0((PyObject *)s, s_refuse_closed) == 0)
                PyErr_SetString(PyExc_RuntimeError, "asyncgpu: _refuse_closed returned");
        } else {
            a = PyObject_CallMethodObjArgs(backend, s_alloc_device, n, (PyObject *)s, NULL);
        }
        if (unhold(&sh))
            Py_CLEAR(a);
    }
    Py_DECREF(backend);
    return a;
}

/* _alloc_device_c(nbytes): stream_alloc above. */
static PyObject *stream_alloc_method(PyObject *self, PyObject *n) {
    return stream_alloc((StreamCore *)self, n);
}

/* A new allocation of nbytes for the context's stream (create_buffer_fast has
 * checked that its impl is a StreamCore). */
static PyObject *alloc_from_backend(ContextCore *c, Py_ssize_t nbytes) {
    PyObject *a, *n = PyLong_FromSsize_t(nbytes);
    if (n == NULL)
        return NULL;
    a = stream_alloc((StreamCore *)c->impl, n);
    Py_DECREF(n);
    return a;
}

/* enqueue_create_buffer's fast path: a DeviceBuffer on memory the current CUDA
 * stream kept (no driver call, no Python) or, where it kept none of that size,
 * on a new allocation of the backend (the arguments' checks and the buffer's
 * fields in C all the same); Py_None (a new reference: the general path takes
 * the call), or NULL with an exception. */
static PyObject *create_buffer_fast(ContextCore *c, PyObject *dtype, PyObject *size) {
    PyObject *entry, *sp, *a;
    Py_ssize_t count, itemsize, nbytes;
    unsigned long long ptr;
    BufferCore *b;
    allocfunc alloc;
    int rc;
    if (device_buffer_type == NULL || device_alloc_type == NULL || !PyLong_CheckExact(size) ||
        c->impl == NULL || !is_a(c->impl, stream_core_type, stream_core_seen))
        Py_RETURN_NONE;
    sp = ((StreamCore *)c->impl)->spare;
    if (sp == NULL || !is_a(sp, spare_core_type, spare_core_seen))
        Py_RETURN_NONE;
    rc = context_open(c);
    if (rc <= 0)
        return rc < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    entry = cached_dtype(dtype);
    if (entry == NULL)
        return PyErr_Occurred() ? NULL : (Py_INCREF(Py_None), Py_None);
    count = PyLong_AsSsize_t(size);
    itemsize = PyLong_AsSsize_t(PyTuple_GetItem(entry, 1));
    if ((count == -1 || itemsize == -1) && PyErr_Occurred()) {
        PyErr_Clear(); /* too large for memory: the general path says so */
        Py_RETURN_NONE;
    }
    if (count <= 0 || itemsize <= 0 || count > PY_SSIZE_T_MAX / itemsize)
        Py_RETURN_NONE;
    nbytes = count * itemsize;
    /* The buffer object first: its allocation may run the collector, and so
     * other threads; from the closing flag's read to the return below no Python
     * code runs, so a close() on another thread either set the flag before
     * (and the general path refuses) or runs on only once the buffer is
     * whole. (The flag is set under the submit lock, which this path does not
     * take: the GIL orders the two.) */
    alloc = (allocfunc)PyType_GetSlot(device_buffer_type, Py_tp_alloc);
    b = (BufferCore *)alloc(device_buffer_type, 0);
    if (b == NULL)
        return NULL;
    if (((StreamCore *)c->impl)->closing) {
        Py_DECREF(b);
        Py_RETURN_NONE; /* the general path raises ContextClosedError */
    }
    a = spare_take((SpareCore *)sp, nbytes, &ptr);
    if (a == NULL) {
        PyObject *o;
        a = alloc_from_backend(c, nbytes);
        if (a == NULL) {
            Py_DECREF(b);
            return NULL;
        }
        ptr = 0;
        if (Py_TYPE(a) == device_alloc_type) {
            o = PyObject_GetAttr(a, s_alloc_ptr);
            if (o == NULL || as_u64(o, &ptr) < 0) {
                Py_XDECREF(o);
                Py_DECREF(a);
                Py_DECREF(b);
                return NULL;
            }
            Py_DECREF(o);
        }
        if (ptr == 0) {
            /* another kind of allocation: DeviceBuffer.__init__ reads what it needs */
            Py_DECREF(b);
            b = (BufferCore *)PyObject_CallFunctionObjArgs(
                (PyObject *)device_buffer_type, (PyObject *)c, a, PyTuple_GetItem(entry, 0), size,
                c->impl, NULL);
            Py_DECREF(a);
            return (PyObject *)b;
        }
    } else if (Py_TYPE(a) != device_alloc_type || ptr == 0) {
        /* not a device allocation of this backend, or of no known address: back
         * for the general path */
        spare_keep((SpareCore *)sp, a, nbytes, ptr);
        Py_DECREF(a);
        Py_DECREF(b);
        Py_RETURN_NONE;
    }
    /* as _BufferBase.__init__(ctx, alloc, dtype, size, owner) sets them */
    b->alloc = a;
    Py_INCREF(c);
    b->ctx = (PyObject *)c;
    b->dtype = PyTuple_GetItem(entry, 0);
    Py_INCREF(b->dtype);
    b->owner = c->impl;
    Py_INCREF(b->owner);
    b->ptr = ptr;
    b->size = count;
    b->nbytes = nbytes;
    b->owns = 1;
    return (PyObject *)b;
}

/* DeviceContext.enqueue_create_buffer (its general path: _enqueue_create_buffer). */
static PyObject *context_enqueue_create_buffer(PyObject *self, PyObject *const *args,
                                               Py_ssize_t n, PyObject *kwnames) {
    if (n == 2 && kwnames == NULL) {
        PyObject *b = create_buffer_fast((ContextCore *)self, args[0], args[1]);
        if (b != Py_None)
            return b;
        Py_DECREF(b);
    }
    return call_general(self, s_general_create, args, n, kwnames);
}

static PyMethodDef context_methods[] = {
    {"enqueue_function", (PyCFunction)(void (*)(void))context_enqueue_function,
     METH_FASTCALL | METH_KEYWORDS,
     "enqueue_function($self, f, /, *args, grid_dim, block_dim, cluster_dim=None, "
     "shared_mem_bytes=None, attributes=(), constant_memory=(), func_attribute=None)\n--\n\n"
     "Launch f on the current stream and return its DeviceEvent at once (cuLaunchKernel; on "
     "the CPU device its NumPy body runs once per block on the pool). This C method takes "
     "a compiled function of this context launched with a grid_dim and block_dim seen "
     "before, untraced, and hands every other call to DeviceContext._enqueue_function, "
     "whose docstring (and the API reference) describes the call in full."},
    {"enqueue_create_buffer", (PyCFunction)(void (*)(void))context_enqueue_create_buffer,
     METH_FASTCALL | METH_KEYWORDS,
     "enqueue_create_buffer($self, dtype, size)\n--\n\n"
     "A device buffer of size elements, allocated in stream order on the current stream "
     "(cuMemAllocFromPoolAsync), owned by it and freed on it. This C method hands out "
     "memory the current CUDA stream kept and hands every other call to "
     "DeviceContext._enqueue_create_buffer, whose docstring (and the API reference) "
     "describes the call in full."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot context_slots[] = {
    {Py_tp_methods, context_methods},
    {Py_tp_members, context_members},
    {Py_tp_traverse, (void *)context_traverse},
    {Py_tp_clear, (void *)context_clear},
    {Py_tp_dealloc, (void *)context_dealloc},
    {Py_tp_doc, "The fields of a DeviceContext and its hot paths (asyncgpu._context "
                "subclasses this)."},
    {0, NULL},
};

static PyType_Spec context_spec = {
    "asyncgpu._native.ContextCore", sizeof(ContextCore), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, context_slots,
};

static int set_type(PyTypeObject **slot, PyObject *o, const char *what) {
    if (!PyType_Check(o)) {
        PyErr_Format(PyExc_TypeError, "configure: %s is a class", what);
        return -1;
    }
    Py_INCREF(o);
    replace_ref((PyObject **)slot, o);
    return 0;
}

/* configure_buffers(device_buffer_type, function_type, as_dtype, numpy_dtype):
 * what the context's fast paths create and check (asyncgpu._context, at import). */
static PyObject *configure_buffers(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "configure_buffers(device_buffer_type, function_type, as_dtype, "
                        "numpy_dtype)");
        return NULL;
    }
    if (!PyType_Check(args[0]) || !PyType_IsSubtype((PyTypeObject *)args[0], buffer_core_type)) {
        PyErr_SetString(PyExc_TypeError, "configure_buffers: the buffer type subclasses BufferCore");
        return NULL;
    }
    if (!PyType_Check(args[1]) ||
        !PyType_IsSubtype((PyTypeObject *)args[1], function_core_type)) {
        PyErr_SetString(PyExc_TypeError,
                        "configure_buffers: the function type subclasses FunctionCore");
        return NULL;
    }
    if (set_type(&device_buffer_type, args[0], "device_buffer_type") ||
        set_type(&function_type, args[1], "function_type") ||
        set_type(&np_dtype_type, args[3], "numpy_dtype"))
        return NULL;
    Py_INCREF(args[2]);
    replace_ref(&as_dtype_fn, args[2]);
    PyDict_Clear(dtype_cache);
    Py_CLEAR(dtype_last_key);
    Py_CLEAR(dtype_last_entry);
    Py_RETURN_NONE;
}

/* configure_scalars(codes, samples) -> bytes: for each code (bytes, one per
 * sample) and sample (a NumPy scalar of the type that code stands for, of a
 * value whose every byte matters), register the sample's type for in-place
 * reads (np_scalar_of) if its value field holds the bytes the general
 * conversion packs; the codes registered. configure_scalars(b"", ()) clears
 * the table: every number goes through float() or __index__. */
static PyObject *configure_scalars(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    char done[128];
    const char *codes;
    Py_ssize_t k, count, got = 0;
    if (n != 2 || !PyBytes_Check(args[0]) || !PyTuple_Check(args[1]) ||
        PyBytes_Size(args[0]) != PyTuple_Size(args[1]) || PyTuple_Size(args[1]) > 64) {
        PyErr_SetString(PyExc_TypeError,
                        "configure_scalars(codes: bytes, samples: tuple), one code per sample");
        return NULL;
    }
    memset(np_scalar_of, 0, sizeof np_scalar_of);
    Py_CLEAR(np_scalar_held);
    np_scalar_held = PyList_New(0);
    if (np_scalar_held == NULL)
        return NULL;
    codes = PyBytes_AsString(args[0]);
    count = PyTuple_Size(args[1]);
    for (k = 0; k < count; k++) {
        PyObject *o = PyTuple_GetItem(args[1], k);
        unsigned char general[8], in_place[8];
        char code = codes[k];
        int width = code_width(code);
        if (width == 0 || (unsigned char)code >= 128) {
            PyErr_Format(PyExc_ValueError, "configure_scalars: %c is not a number's code", code);
            return NULL;
        }
        if (pack_one(code, o, general, NULL)) {
            PyErr_Clear(); /* not a number of this code at all: not registered */
            continue;
        }
        memset(in_place, 0, 8);
        memcpy(in_place, (const char *)o + sizeof(PyObject), (size_t)width);
        if (memcmp(general, in_place, 8) == 0) {
            if (PyList_Append(np_scalar_held, (PyObject *)Py_TYPE(o))) {
                memset(np_scalar_of, 0, sizeof np_scalar_of);
                return NULL;
            }
            np_scalar_of[(unsigned char)code] = Py_TYPE(o);
            done[got++] = code;
        }
    }
    return PyBytes_FromStringAndSize(done, got);
}

/* set_exiting(flag): whether the interpreter is exiting (set at exit): then a
 * dropped buffer's memory is never kept here, but given to _release_memory
 * (which abandons it; see _BufferBase). */
static PyObject *set_exiting(PyObject *self, PyObject *flag) {
    int v = PyObject_IsTrue(flag);
    if (v < 0)
        return NULL;
    exiting = v;
    Py_RETURN_NONE;
}

/* configure(event_type, sweep_later, mark_every): the DeviceEvent class (a
 * subclass of EventCore) that a launch creates, the watcher's sweep_later,
 * and _PolledStream.MARK_EVERY. */
static PyObject *configure(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    long long every;
    if (n != 3 && n != 5) {
        PyErr_SetString(PyExc_TypeError, "configure(event_type, sweep_later, mark_every"
                                         "[, cuda_stream_type, device_alloc_type])");
        return NULL;
    }
    if (!PyType_Check(args[0]) ||
        !PyType_IsSubtype((PyTypeObject *)args[0], event_core_type)) {
        PyErr_SetString(PyExc_TypeError, "configure: event_type subclasses EventCore");
        return NULL;
    }
    every = PyLong_AsLongLong(args[2]);
    if (every == -1 && PyErr_Occurred())
        return NULL;
    if (every < 1) {
        PyErr_SetString(PyExc_ValueError, "configure: mark_every is at least 1");
        return NULL;
    }
    if (n == 5) {
        if (!PyType_Check(args[3]) ||
            !PyType_IsSubtype((PyTypeObject *)args[3], stream_core_type)) {
            PyErr_SetString(PyExc_TypeError, "configure: the stream type subclasses StreamCore");
            return NULL;
        }
        if (set_type(&cuda_stream_type, args[3], "cuda_stream_type") ||
            set_type(&device_alloc_type, args[4], "device_alloc_type"))
            return NULL;
    }
    Py_INCREF(args[0]);
    replace_ref((PyObject **)&event_type, args[0]);
    Py_INCREF(args[1]);
    replace_ref(&sweep_later, args[1]);
    mark_every = every;
    Py_RETURN_NONE;
}

/* Keep new references to args[0..n) in *slots[0..n), dropping what they held. */
static void keep_refs(PyObject **const slots[], PyObject *const *args, Py_ssize_t n) {
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        Py_INCREF(args[i]);
        replace_ref(slots[i], args[i]);
    }
}

/* configure_futures(copy_context, cancelled_error, invalid_state_error): what a
 * DirectFuture calls and raises (contextvars.copy_context,
 * asyncio.CancelledError, asyncio.InvalidStateError). */
static PyObject *configure_futures(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 3 || !PyCallable_Check(args[0]) || !PyType_Check(args[1]) || !PyType_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "configure_futures(copy_context, cancelled_error, "
                                         "invalid_state_error)");
        return NULL;
    }
    PyObject **const slots[] = {&copy_context_fn, &cancelled_error, &invalid_state_error};
    keep_refs(slots, args, 3);
    Py_RETURN_NONE;
}

/* configure_await(get_running_loop, await_event, await_future): what an
 * EventCore's await calls (see event_await). */
static PyObject *configure_await(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 3 || !PyCallable_Check(args[0]) || !PyCallable_Check(args[1]) ||
        !PyCallable_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "configure_await(get_running_loop, await_event, await_future)");
        return NULL;
    }
    PyObject **const slots[] = {&running_loop_fn, &await_event_fn, &await_future_fn};
    keep_refs(slots, args, 3);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(launch_entry, write64_entry[, record_entry, query_entry]) -> the previous "
     "four: the driver's cuLaunchKernel, cuStreamWriteValue64, cuEventRecord and "
     "cuEventQuery entry points (from cuGetProcAddress; without the last two, the "
     "markers after eager launches are counter writes)."},
    {"write64", (PyCFunction)(void (*)(void))write64, METH_FASTCALL,
     "write64(stream, addr, value) -> CUresult: cuStreamWriteValue64."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(func, dims, stream, types, codes, args, data, pointers[, counter, value]) "
     "-> CUresult (or -1: an argument's type is not the plan's; nothing launched)."},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(event_type, sweep_later, mark_every[, cuda_stream_type, device_alloc_type]): "
     "what StreamCore._launch_c creates and calls, and the CUDA classes the context's fast "
     "paths take."},
    {"configure_buffers", (PyCFunction)(void (*)(void))configure_buffers, METH_FASTCALL,
     "configure_buffers(device_buffer_type, function_type, as_dtype, numpy_dtype): what the "
     "context's fast paths create and check."},
    {"configure_scalars", (PyCFunction)(void (*)(void))configure_scalars, METH_FASTCALL,
     "configure_scalars(codes, samples) -> bytes: the NumPy scalar types whose value a "
     "launch copies from the object itself, checked with a sample each; the codes "
     "registered."},
    {"configure_futures", (PyCFunction)(void (*)(void))configure_futures, METH_FASTCALL,
     "configure_futures(copy_context, cancelled_error, invalid_state_error): what a "
     "DirectFuture calls and raises."},
    {"configure_await", (PyCFunction)(void (*)(void))configure_await, METH_FASTCALL,
     "configure_await(get_running_loop, await_event, await_future): what an event's await "
     "calls: asyncio._get_running_loop, and the Python awaits of an event (no stream, no "
     "asyncio loop) and of an event behind a future that is not a DirectFuture."},
    {"launch_key", (PyCFunction)(void (*)(void))launch_key, METH_FASTCALL,
     "launch_key(grid, block, cluster, shared_mem, attributes) -> the key of a launch "
     "configuration in a function's cache (_cfgs), as the compiled enqueue_function "
     "looks it up."},
    {"set_exiting", set_exiting, METH_O,
     "set_exiting(flag): the interpreter is exiting: dropped buffers keep no memory."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "asyncgpu._native",
    "Direct driver calls of asyncgpu's enqueue hot path (see _native.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

static PyObject *intern(const char *s) { return PyUnicode_InternFromString(s); }

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m;
    s_ptr = intern("_ptr");
    s_poll = intern("_poll");
    s_future = intern("_future");
    s_alloc = intern("_alloc");
    s_ctx = intern("_ctx");
    s_state = intern("_state");
    s_closed = intern("closed");
    s_place_marker = intern("_place_marker");
    s_refuse_closed = intern("_refuse_closed");
    s_retire = intern("_retire");
    s_completed = intern("_completed");
    s_acquire = intern("acquire");
    s_release = intern("release");
    s_append = intern("append");
    s_popleft = intern("popleft");
    s_finish_retired = intern("_finish_retired");
    s_need = intern("_need");
    s_impl = intern("_impl");
    s_last = intern("last");
    s_dims = intern("dims");
    s_handle = intern("handle");
    s_launch_general = intern("_launch");
    s_new_marker_event = intern("_new_marker_event");
    s_wake_waiters = intern("_wake_waiters");
    s_trace_end = intern("_trace_end");
    s_types = intern("types");
    s_codes = intern("codes");
    s_addr = intern("addr");
    s_pointers = intern("pointers");
    s_release_memory = intern("_release_memory");
    s_open = intern("open");
    s_trace = intern("trace");
    s_grid_dim = intern("grid_dim");
    s_block_dim = intern("block_dim");
    s_launch = intern("launch");
    s_alloc_ptr = intern("ptr");
    s_itemsize = intern("itemsize");
    s_general_function = intern("_enqueue_function");
    s_general_create = intern("_enqueue_create_buffer");
    s_alloc_device = intern("alloc_device");
    s_backend = intern("backend");
    s_record = intern("record");
    s_kernel = intern("kernel");
    s_name = intern("name");
    s_call_soon = intern("call_soon");
    s_run = intern("run");
    s_context = intern("context");
    s_msg = intern("msg");
    s_loop = intern("loop");
    empty_tuple = PyTuple_New(0);
    dtype_cache = PyDict_New();
    if (!s_ptr || !s_alloc || !s_ctx || !s_state || !s_closed || !s_place_marker || !s_retire ||
        !s_refuse_closed ||
        !s_alloc_device || !s_backend || !s_completed || !s_acquire || !s_release || !s_append || !s_popleft ||
        !s_finish_retired || !s_need || !s_impl || !s_last ||
        !s_dims || !s_handle || !s_launch_general || !s_new_marker_event || !s_wake_waiters || !s_types ||
        !s_trace_end ||
        !s_codes || !s_addr || !s_pointers || !s_release_memory || !s_open || !s_trace ||
        !s_grid_dim || !s_block_dim || !s_launch || !s_alloc_ptr || !s_itemsize ||
        !s_general_function || !s_general_create || !empty_tuple || !dtype_cache ||
        !s_call_soon || !s_run || !s_context || !s_msg || !s_loop || !s_record || !s_kernel ||
        !s_name)
        return NULL;
    event_core_type = (PyTypeObject *)PyType_FromSpec(&event_spec);
    if (event_core_type == NULL)
        return NULL;
    stream_core_type = (PyTypeObject *)PyType_FromSpec(&stream_spec);
    if (stream_core_type == NULL)
        return NULL;
    buffer_core_type = (PyTypeObject *)PyType_FromSpec(&buffer_spec);
    if (buffer_core_type == NULL)
        return NULL;
    spare_core_type = (PyTypeObject *)PyType_FromSpec(&spare_spec);
    if (spare_core_type == NULL)
        return NULL;
    context_core_type = (PyTypeObject *)PyType_FromSpec(&context_spec);
    if (context_core_type == NULL)
        return NULL;
    function_core_type = (PyTypeObject *)PyType_FromSpec(&function_spec);
    if (function_core_type == NULL)
        return NULL;
    rlock_type = (PyTypeObject *)PyType_FromSpec(&rlock_spec);
    if (rlock_type == NULL)
        return NULL;
    state_core_type = (PyTypeObject *)PyType_FromSpec(&state_spec);
    if (state_core_type == NULL)
        return NULL;
    ref_core_type = (PyTypeObject *)PyType_FromSpec(&ref_spec);
    if (ref_core_type == NULL)
        return NULL;
    kernel_core_type = (PyTypeObject *)PyType_FromSpec(&kernel_spec);
    if (kernel_core_type == NULL)
        return NULL;
    event_queue_type = (PyTypeObject *)PyType_FromSpec(&queue_spec);
    if (event_queue_type == NULL)
        return NULL;
    direct_future_type = (PyTypeObject *)PyType_FromSpec(&future_spec);
    if (direct_future_type == NULL)
        return NULL;
    m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(event_core_type);
    Py_INCREF(stream_core_type);
    Py_INCREF(buffer_core_type);
    Py_INCREF(spare_core_type);
    Py_INCREF(context_core_type);
    Py_INCREF(function_core_type);
    Py_INCREF(rlock_type);
    Py_INCREF(state_core_type);
    Py_INCREF(ref_core_type);
    Py_INCREF(kernel_core_type);
    Py_INCREF(event_queue_type);
    Py_INCREF(direct_future_type);
    if (PyModule_AddIntConstant(m, "MARKER_FAILED", MARKER_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "SPARE_SIZES", SPARE_SIZES) < 0 ||
        PyModule_AddObject(m, "EventCore", (PyObject *)event_core_type) < 0 ||
        PyModule_AddObject(m, "StreamCore", (PyObject *)stream_core_type) < 0 ||
        PyModule_AddObject(m, "BufferCore", (PyObject *)buffer_core_type) < 0 ||
        PyModule_AddObject(m, "SpareCore", (PyObject *)spare_core_type) < 0 ||
        PyModule_AddObject(m, "ContextCore", (PyObject *)context_core_type) < 0 ||
        PyModule_AddObject(m, "FunctionCore", (PyObject *)function_core_type) < 0 ||
        PyModule_AddObject(m, "RLock", (PyObject *)rlock_type) < 0 ||
        PyModule_AddObject(m, "StateCore", (PyObject *)state_core_type) < 0 ||
        PyModule_AddObject(m, "RefCore", (PyObject *)ref_core_type) < 0 ||
        PyModule_AddObject(m, "KernelCore", (PyObject *)kernel_core_type) < 0 ||
        PyModule_AddObject(m, "EventQueue", (PyObject *)event_queue_type) < 0 ||
        PyModule_AddObject(m, "DirectFuture", (PyObject *)direct_future_type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
