/* The compiled engine of tensorplay_p2p: the hot path of point-to-point calls and collectives, in C over mpi4py's
 * C API.
 *
 * It handles the common case (host buffers that are contiguous, strided numpy arrays it describes or packs
 * itself, or buffers already resolved to a plain MPI buffer; any group, no checked mode, no watchdog, no torch
 * profiler recording) with nothing but an empty Work per op between the call and MPI, and its waits test first, so
 * that an op already complete never gives up the GIL.  Anything else is handed, unchanged and before anything is
 * posted, to the Python function or method it stands in for (the reference, given by ``setup_work``, ``setup_ops``
 * and ``setup_collectives``), so both engines give the same results, exceptions and messages.  Error messages are
 * always worded by the package's Python code (``errors``, ``buffers``, ``validate``): nothing here words one.
 *
 * Types (each is the base of the Python class of the same role, which adds every other method):
 *   OpBase     - tuple subclass, the base of ``P2POp``; its constructor checks the common case inline.
 *   WorkBase   - the fields of ``Work``; ``wait()`` and the dropped-handle keep-alive.
 *   BatchBase  - a list subclass, the base of ``BatchWork``: its items are the ops' Works; a batch posted
 *                here keeps its ops in C arrays, its Works shells, until Python code reads a field of
 *                one of them or ``_works``, which fills them in.
 * and of its own:
 *   Collective - each compiled collective, a callable whose ``__wrapped__`` is its Python reference.
 *   Packed     - a packed strided message's after-hook: a receive copied out, the pooled buffer given back.
 *
 * Sections, in order: references and state; counts; blocking waits; one buffer; strided numpy arrays; WorkBase;
 * BatchBase; P2POp; batch_isend_irecv; isend, irecv, send, recv; the collectives; setup and the contract.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>
#include <limits.h>
#include <sched.h>
#include <string.h>
#include <time.h>
#include <mpi.h>
#include <mpi4py/mpi4py.h>

#if defined(OMPI_MAJOR_VERSION)
#define TP2P_ABI "openmpi"
#elif defined(MPICH_VERSION)
#define TP2P_ABI "mpich"
#else
#define TP2P_ABI "unknown"
#endif

#define SMALL 4 /* ops of a batch kept inline in the batch object */

/* --- references and package state, given by setup_work / setup_ops ----------------------------- */

static PyObject *Work_type, *Batch_type, *Op_type;            /* the Python classes */
static PyObject *ref_work_wait, *ref_batch_wait, *ref_new_op; /* the Python methods replaced */
static PyObject *ref_isend, *ref_irecv, *ref_send, *ref_recv, *ref_batch, *ref_post_resolved, *mpi_byte, *layouts_dict;
static PyObject *pool_keep_obj, *pool_keep_bytes_obj; /* the packing pool's bounds, read into pool_keep(_bytes) */
static PyObject *dropped, *reap_dropped, *retired, *release_retired;
static PyObject *world, *group_type, *resolvers, *resolve, *release;
static PyObject *overlap_error, *failure, *size_error;
static PyObject *state, *watchdog_dict, *validate_dict, *ndarray;
static PyObject *request_null, *mpi_exception, *pending_obj, *done_obj, *failed_obj, *busy_error;
static PyObject *lean_isend_obj, *lean_irecv_obj; /* this module's isend / irecv */
static long tag_ub = 0;
static int world_size = 0, world_rank = -1;

static PyObject *s_checked, *s_active, *s_untrack, *s_single_threaded, *s_communicator, *s_global_of, *s_group_of;
static PyObject *s_profiler_module, *s_profiler_flag, *s_pack_max, *s_timeout;
static PyObject *s_fail, *s_complete, *s_finish;
static PyObject *s_wait, *s_source_rank, *s_withdraw, *s_batch_what, *s_isend_what, *s_irecv_what, *s_send_what,
    *s_recv_what;

enum { PENDING = 0, DONE = 1, FAILED = 2 };

/* --- counts: how many calls the engine took, and how many it handed to the Python reference ------------------ */

enum {
    C_ISEND,
    C_IRECV,
    C_SEND,
    C_RECV,
    C_BATCH,
    C_OP,
    C_WORK_WAIT,
    C_BATCH_WAIT,
    C_ALL_REDUCE,
    C_BROADCAST,
    C_REDUCE,
    C_ALL_GATHER_INTO_TENSOR,
    C_REDUCE_SCATTER_TENSOR,
    C_ALL_TO_ALL_SINGLE,
    C_BARRIER,
    C_ALL_GATHER,
    C_GATHER,
    C_SCATTER,
    C_HALO_PASS,
    C_CALLS
};
static const char *const call_names[C_CALLS] = {
    "isend",
    "irecv",
    "send",
    "recv",
    "batch_isend_irecv",
    "P2POp",
    "Work.wait",
    "BatchWork.wait",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
    "all_gather",
    "gather",
    "scatter",
    "HaloPass",
};
static Py_ssize_t calls_made[C_CALLS], calls_handed[C_CALLS]; /* under the GIL: plain increments */

/* A call handed to its Python reference, counted: ``HANDED(C_ISEND, expression)``. */
#define HANDED(which, expression) (calls_handed[which]++, (expression))

static double
monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of time.monotonic() */
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Whether a torch profiler may be recording (``profiling.active()``, in C): torch.autograd.profiler's
 * ``_is_profiler_enabled``.  Until that module is in sys.modules, one lookup there per call; from then on, one lookup
 * in its namespace, held here (a module deleted from sys.modules and imported anew is not seen).  Where it cannot
 * tell (sys.modules is not a dict), 1: the Python path decides. */
static PyObject *profiler_namespace; /* torch.autograd.profiler's __dict__, once imported */

static int
profiler_recording(void)
{
    if (profiler_namespace == NULL) {
        PyObject *modules = PyImport_GetModuleDict(); /* borrowed */
        if (!PyDict_CheckExact(modules))
            return 1;
        PyObject *module = PyDict_GetItemWithError(modules, s_profiler_module);
        if (module == NULL) {
            PyErr_Clear();
            return 0;
        }
        if (!PyModule_Check(module))
            return 1;
        PyObject *namespace = PyModule_GetDict(module);                    /* borrowed */
        if (PyDict_GetItemWithError(namespace, s_profiler_flag) == NULL) { /* still being imported */
            PyErr_Clear();
            return 1;
        }
        profiler_namespace = Py_NewRef(namespace);
    }
    return PyDict_GetItemWithError(profiler_namespace, s_profiler_flag) == Py_True;
}

/* Whether the lean path may run now: set up, no checked mode, no watchdog, any thread may call MPI, no torch
 * profiler recording (its events are recorded by the Python path). */
static int
gate(void)
{
    PyObject *v;
    if (world == NULL || profiler_recording())
        return 0;
    v = PyObject_GetAttr(state, s_checked);
    if (v == NULL) {
        PyErr_Clear();
        return 0;
    }
    int checked = v != Py_False;
    Py_DECREF(v);
    if (checked)
        return 0;
    v = PyDict_GetItemWithError(watchdog_dict, s_active);
    if (v != Py_False)
        return 0;
    v = PyDict_GetItemWithError(validate_dict, s_single_threaded);
    if (v != Py_False)
        return 0;
    return 1;
}

/* The communicator of a group when it is usable here (a live member; a new reference, whose handle is read when
 * posting), else NULL with no error set. */
static PyObject *
group_comm(PyObject *group)
{
    PyObject *comm = PyObject_GetAttr(group, s_communicator);
    if (comm == NULL)
        PyErr_Clear();
    else if (comm == Py_None || !PyObject_TypeCheck(comm, &PyMPIComm_Type))
        Py_CLEAR(comm);
    return comm;
}

/* Whether ``group`` is usable here. */
static int
group_live(PyObject *group)
{
    PyObject *comm = group_comm(group);
    Py_XDECREF(comm);
    return comm != NULL;
}

/* Clear a Python-level error raised by a resolver (the Python path raises it again, worded), but keep
 * KeyboardInterrupt, SystemExit and the like: 0 if cleared, -1 if it must propagate. */
static int
clear_error(void)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyErr_Clear();
    return 0;
}

/* Free the datatypes evicted from the cache while a call was prepared, as ``ops`` does in ``finally``: ``result``
 * passes through, and an exception being raised is kept. */
static PyObject *
release_retired_after(PyObject *result)
{
    if (retired == NULL || PyList_GET_SIZE(retired) == 0)
        return result;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallNoArgs(release_retired);
    if (r == NULL) {
        Py_XDECREF(result);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    Py_DECREF(r);
    PyErr_Restore(type, value, tb);
    return result;
}

/* The bytes a completed receive got (MPI_Get_elements_x: right for messages over 2 GiB too). */
static Py_ssize_t
received_bytes(MPI_Status *status)
{
    MPI_Count count = 0;
    MPI_Get_elements_x(status, MPI_BYTE, &count);
    return (Py_ssize_t)count;
}

/* A status as mpi4py initialises one, for MPI calls that may leave it unset on an error. */
static void
blank_status(MPI_Status *status)
{
    status->MPI_SOURCE = MPI_ANY_SOURCE;
    status->MPI_TAG = MPI_ANY_TAG;
    status->MPI_ERROR = MPI_SUCCESS;
}

static int
reap(void)
{
    if (PyList_GET_SIZE(dropped) == 0)
        return 0;
    PyObject *r = PyObject_CallNoArgs(reap_dropped);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* --- blocking waits, for the signal handler's report -------------------------------------------- */

#define WAIT_SLOTS 16
typedef struct {
    unsigned long ident;    /* thread, 0: free */
    unsigned long serial;   /* which wait: the signal handler compares it before and after its grace */
    PyObject *handle;       /* borrowed: the Work or BatchWork waited on, or NULL for a blocking call */
    PyObject *group;        /* borrowed (blocking call) */
    int receive, peer, tag; /* a collective: peer is its root's group rank, or -1 */
    Py_ssize_t nbytes;
    double posted;
    PyObject *name; /* borrowed: a blocking collective's name (interned), or NULL for a send/recv */
} WaitRecord;

static WaitRecord waits[WAIT_SLOTS];
static unsigned long wait_serial = 0;

static WaitRecord *
wait_begin(PyObject *handle)
{
    unsigned long ident = PyThread_get_thread_ident();
    for (int i = 0; i < WAIT_SLOTS; i++) {
        if (waits[i].ident == 0) {
            waits[i].ident = ident;
            waits[i].serial = ++wait_serial;
            waits[i].handle = handle;
            waits[i].name = NULL;
            return &waits[i];
        }
    }
    return NULL; /* more threads waiting than slots: this one goes unreported */
}

static void
wait_end(WaitRecord *record)
{
    if (record != NULL)
        record->ident = 0;
}

PyDoc_STRVAR(waiting_doc, "waiting($module, /)\n--\n\n"
                          "The compiled waits in progress: {thread ident: (serial, handle, or (receive, group, "
                          "peer, tag, nbytes, posted) for a send/recv, or (name, group, root, nbytes, posted) for a "
                          "collective)}.");

static PyObject *
waiting(PyObject *module, PyObject *unused)
{
    PyObject *result = PyDict_New();
    if (result == NULL)
        return NULL;
    for (int i = 0; i < WAIT_SLOTS; i++) {
        WaitRecord *w = &waits[i];
        if (w->ident == 0)
            continue;
        PyObject *what = w->handle != NULL ? Py_NewRef(w->handle)
                         : w->name != NULL ? Py_BuildValue("(OOind)", w->name, w->group, w->peer, w->nbytes, w->posted)
                                           : Py_BuildValue("(OOiind)", w->receive ? Py_True : Py_False, w->group,
                                                           w->peer, w->tag, w->nbytes, w->posted);
        PyObject *item = what ? Py_BuildValue("(kN)", w->serial, what) : NULL;
        PyObject *key = PyLong_FromUnsignedLong(w->ident);
        if (item == NULL || key == NULL || PyDict_SetItem(result, key, item) < 0) {
            Py_XDECREF(item);
            Py_XDECREF(key);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(item);
        Py_DECREF(key);
    }
    return result;
}

/* --- one buffer -------------------------------------------------------------------------------- */

typedef struct {
    void *address;
    int count;
    PyObject *datatype; /* borrowed from ``keep``: a derived datatype, read when posting; NULL for MPI_BYTE */
    Py_ssize_t nbytes;
    PyObject *keep;  /* owned: what keeps the memory alive (the array, or the resolved tuple) */
    PyObject *after; /* owned: a packed message's hook at completion (a Packed), or NULL */
} Buffer;

static MPI_Datatype
datatype_of(Buffer *buffer)
{
    return buffer->datatype == NULL ? MPI_BYTE : *PyMPIDatatype_Get(buffer->datatype);
}

/* --- strided numpy arrays: derived datatypes and packing ---------------------------------------------- */

/* A strided numpy array below the packing range travels in place, described by a derived datatype, as the Python
 * path sends it (``layouts.simplify``, ``layouts.build``: the same bytes in C order, so the same type signature).
 * The datatypes are built here once per simplified layout and kept: at most STRIDED_KEPT of them, never freed while
 * the process runs (a full cache hands new layouts to the Python path, whose own cache evicts).  Only non-negative
 * strides whose elements do not overlap, and up to STRIDED_DIMS dimensions; anything else goes to the resolver. */
#define STRIDED_DIMS 8
#define STRIDED_KEPT 256
typedef struct {
    Py_ssize_t block;
    int ndim;
    Py_ssize_t extent[STRIDED_DIMS], stride[STRIDED_DIMS];
} Strided;
typedef struct {
    Strided layout;
    PyObject *datatype; /* owned: mpi4py's object of the committed datatype */
} KeptLayout;
static KeptLayout kept_layouts[STRIDED_KEPT];
static int kept_count = 0;

/* ``view`` (shape and byte strides) simplified as layouts.simplify does: dims of extent 1 dropped, dims that walk
 * on from each other merged, the innermost contiguous run taken as the block.  1, or 0 where the C path does not
 * describe it. */
static int
simplify_view(Py_buffer *view, Strided *out)
{
    if (view->ndim < 1 || view->ndim > STRIDED_DIMS || view->strides == NULL || view->len == 0)
        return 0;
    int n = 0;
    for (int d = 0; d < view->ndim; d++) {
        Py_ssize_t extent = view->shape[d], stride = view->strides[d];
        if (extent == 1)
            continue;
        if (stride <= 0)
            return 0;
        if (n > 0 && out->stride[n - 1] == extent * stride) {
            out->extent[n - 1] *= extent;
            out->stride[n - 1] = stride;
        } else {
            out->extent[n] = extent;
            out->stride[n] = stride;
            n++;
        }
    }
    out->block = view->itemsize;
    if (n > 0 && out->stride[n - 1] == view->itemsize)
        out->block = view->itemsize * out->extent[--n];
    out->ndim = n;
    /* elements apart (layouts.may_overlap): each dim, innermost first, steps past what the ones inside cover */
    Py_ssize_t covered = out->block;
    for (int d = n - 1; d >= 0; d--) {
        if (out->stride[d] < covered)
            return 0;
        covered = out->stride[d] * (out->extent[d] - 1) + covered;
    }
    return n > 0;
}

/* The committed datatype of ``layout`` (borrowed from the cache), or NULL (no error) where it is full or MPI fails. */
static PyObject *
strided_datatype(Strided *layout)
{
    for (int i = 0; i < kept_count; i++) {
        Strided *k = &kept_layouts[i].layout;
        if (k->block == layout->block && k->ndim == layout->ndim &&
            memcmp(k->extent, layout->extent, sizeof(Py_ssize_t) * (size_t)layout->ndim) == 0 &&
            memcmp(k->stride, layout->stride, sizeof(Py_ssize_t) * (size_t)layout->ndim) == 0)
            return kept_layouts[i].datatype;
    }
    if (kept_count == STRIDED_KEPT || layout->block > INT_MAX)
        return NULL;
    MPI_Datatype built, outer;
    if (MPI_Type_contiguous((int)layout->block, MPI_BYTE, &built) != MPI_SUCCESS)
        return NULL;
    for (int d = layout->ndim - 1; d >= 0; d--) { /* as layouts.build: hvectors from the innermost dim out */
        int code = layout->extent[d] <= INT_MAX
                       ? MPI_Type_create_hvector((int)layout->extent[d], 1, layout->stride[d], built, &outer)
                       : MPI_ERR_COUNT;
        MPI_Type_free(&built);
        if (code != MPI_SUCCESS)
            return NULL;
        built = outer;
    }
    if (MPI_Type_commit(&built) != MPI_SUCCESS) {
        MPI_Type_free(&built);
        return NULL;
    }
    PyObject *datatype = PyMPIDatatype_New(built);
    if (datatype == NULL) {
        PyErr_Clear();
        MPI_Type_free(&built);
        return NULL;
    }
    kept_layouts[kept_count] = (KeptLayout){*layout, datatype};
    return kept_layouts[kept_count++].datatype;
}

/* One run of the innermost dim: ``n`` blocks ``stride`` bytes apart, to or from consecutive blocks at ``packed``.
 * A block of 1, 2, 4 or 8 bytes is one load and one store (memcpy of a constant size). */
#define COPY_RUN(size)                                               \
    for (Py_ssize_t i = 0; i < n; i++, at += stride, packed += size) \
        if (pack)                                                    \
            memcpy(packed, at, size);                                \
        else                                                         \
            memcpy(at, packed, size);                                \
    return packed;
static char *
copy_run(char *at, Py_ssize_t stride, Py_ssize_t n, Py_ssize_t block, char *packed, int pack)
{
    switch (block) {
    case 8:
        COPY_RUN(8)
    case 4:
        COPY_RUN(4)
    case 2:
        COPY_RUN(2)
    case 1:
        COPY_RUN(1)
    default:
        COPY_RUN((size_t)block)
    }
}
#undef COPY_RUN

/* Copy between the elements of ``layout`` from ``base`` and one contiguous run at ``packed``, in C order: into the
 * run (``pack``) or out of it. */
static void
strided_copy(char *base, const Strided *layout, char *packed, int pack)
{
    int inner = layout->ndim - 1; /* at least one dim: a layout with none is contiguous */
    Py_ssize_t index[STRIDED_DIMS] = {0}, runs = 1;
    for (int d = 0; d < inner; d++)
        runs *= layout->extent[d];
    char *at = base;
    for (Py_ssize_t r = 0; r < runs; r++) {
        packed = copy_run(at, layout->stride[inner], layout->extent[inner], layout->block, packed, pack);
        for (int d = inner - 1; d >= 0; d--) { /* the next run: the innermost outer dim steps first */
            at += layout->stride[d];
            if (++index[d] < layout->extent[d])
                break;
            at -= layout->stride[d] * layout->extent[d];
            index[d] = 0;
        }
    }
}

/* The packing buffers: plain memory by power-of-two size, reused here on the terms of the package's packing pool
 * (``devices.packing_pool``: at most ``pool_keep`` buffers of a size and ``pool_keep_bytes`` in all kept for reuse,
 * buffers of other sizes dropped first, the largest first, to make room for the size in use), whose ``in_use``,
 * ``kept_bytes`` and ``trim()`` count and drop these too (``HostPool.share``).  The pool's own take and give are
 * Python calls, about as costly as packing a few KiB.  Only under the GIL. */
#define POOL_CLASSES 48
static char **pool_free[POOL_CLASSES]; /* per size class 1 << c: a stack of pool_keep slots, made on first use */
static int pool_count[POOL_CLASSES];
static Py_ssize_t pool_keep, pool_keep_bytes, pool_kept, pool_leased;

/* A buffer of at least ``nbytes`` (its size class in ``*cls``), or NULL with MemoryError. */
static char *
pool_lease(Py_ssize_t nbytes, int *cls)
{
    int c = 0;
    while (c < POOL_CLASSES - 1 && ((Py_ssize_t)1 << c) < nbytes)
        c++;
    *cls = c;
    char *buffer = NULL;
    if (pool_count[c] > 0) {
        buffer = pool_free[c][--pool_count[c]];
        pool_kept -= (Py_ssize_t)1 << c;
    } else if ((buffer = PyMem_RawMalloc((size_t)1 << c)) == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    pool_leased++;
    return buffer;
}

static void
pool_drop(int c)
{
    PyMem_RawFree(pool_free[c][--pool_count[c]]);
    pool_kept -= (Py_ssize_t)1 << c;
}

/* ``buffer`` of size class ``c`` back, kept for reuse within the bounds or freed. */
static void
pool_return(char *buffer, int c)
{
    Py_ssize_t size = (Py_ssize_t)1 << c;
    pool_leased--;
    if (pool_free[c] == NULL && pool_keep > 0)
        pool_free[c] = PyMem_RawCalloc((size_t)pool_keep, sizeof(char *));
    if (pool_free[c] == NULL || pool_count[c] >= pool_keep || size > pool_keep_bytes) {
        PyMem_RawFree(buffer);
        return;
    }
    for (int o = POOL_CLASSES - 1; o >= 0 && pool_kept + size > pool_keep_bytes; o--)
        while (o != c && pool_count[o] > 0 && pool_kept + size > pool_keep_bytes)
            pool_drop(o);
    while (pool_count[c] > 0 && pool_kept + size > pool_keep_bytes)
        pool_drop(c);
    pool_free[c][pool_count[c]++] = buffer;
    pool_kept += size;
}

PyDoc_STRVAR(packing_counts_doc, "packing_counts($module, /)\n--\n\n"
                                 "The packing buffers: (in use, bytes kept for reuse).");
PyDoc_STRVAR(packing_trim_doc, "packing_trim($module, /)\n--\n\nFree the packing buffers kept for reuse.");

static PyObject *
packing_counts(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("(nn)", pool_leased, pool_kept);
}

static PyObject *
packing_trim(PyObject *module, PyObject *unused)
{
    for (int c = 0; c < POOL_CLASSES; c++)
        while (pool_count[c] > 0)
            pool_drop(c);
    Py_RETURN_NONE;
}

/* Packed: a packed message's after-hook, ``after(receipt, error)`` as the Python path calls one (``work._run_after``):
 * a receive's message is copied into the array's elements unless it failed, then the buffer goes back to the
 * packing buffers (as ``buffers.place``'s packed path gives its buffer back to the pool); returns ``error``.  A hook
 * dropped unrun (an op never posted) gives its buffer back too. */
typedef struct {
    PyObject_HEAD
    char *packed;    /* the packing buffer, until given back; NULL after */
    int size_class;  /* its size class (pool_lease) */
    PyObject *array; /* a receive's strided array, or NULL */
    char *base;      /* its lowest byte */
    Strided layout;
} PackedObject;

/* Copy a receive out (``ok``) and give the buffer back: 0 (nothing here can fail). */
static int
packed_finish(PackedObject *self, int ok)
{
    if (ok && self->array != NULL && self->packed != NULL)
        strided_copy(self->base, &self->layout, self->packed, 0);
    Py_CLEAR(self->array);
    if (self->packed != NULL)
        pool_return(self->packed, self->size_class);
    self->packed = NULL;
    return 0;
}

static PyObject *
packed_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    PyObject *receipt, *error;
    if (!PyArg_UnpackTuple(args, "after", 2, 2, &receipt, &error))
        return NULL;
    if (packed_finish((PackedObject *)self, error == Py_None) < 0)
        return NULL;
    return Py_NewRef(error);
}

static void
packed_dealloc(PackedObject *self)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (packed_finish(self, 0) < 0)
        PyErr_WriteUnraisable((PyObject *)self);
    PyErr_Restore(type, value, tb);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject Packed_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorplay_p2p._src.engine._accel.Packed",
    .tp_doc = PyDoc_STR("A packed message's after-hook: a receive copied out, the pooled buffer given back."),
    .tp_basicsize = sizeof(PackedObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_call = packed_call,
    .tp_dealloc = (destructor)packed_dealloc,
};

/* A strided numpy array, as the Python path sends it (``buffers.place``): in place with its datatype below
 * PACK_MIN and above PACK_MAX, and between them packed through a buffer of the packing pool (a send packed now, a
 * receive copied out at completion: ``out->after``).  1 and ``out`` filled, 0 for the resolver (a layout this does
 * not describe), -1 on an error. */
static int
strided_buffer(PyObject *tensor, int receive, Buffer *out)
{
    Py_buffer view;
    if (PyObject_GetBuffer(tensor, &view, PyBUF_RECORDS_RO | (receive ? PyBUF_WRITABLE : 0)) < 0)
        return clear_error();
    Strided layout;
    int ok = view.len <= INT_MAX && (view.format == NULL || strchr(view.format, 'O') == NULL) &&
             simplify_view(&view, &layout);
    PyObject *high = ok ? PyDict_GetItemWithError(layouts_dict, s_pack_max) : NULL;
    Py_ssize_t pack_max = high && PyLong_Check(high) ? PyLong_AsSsize_t(high) : -1;
    PyErr_Clear();
    ok = ok && pack_max >= 0;
    /* packed in C up to PACK_MAX, whatever the size: a pooled buffer and a C copy cost less than MPICH's walk of a
     * datatype from the smallest messages up (1.4 to 1.6 times a hand-packed send's bandwidth at 16 B to 4 KiB, where
     * the datatype gets 0.5 to 1.4); PACK_MIN is the bound of the Python path's numpy packing (layouts.packs) */
    int packs = ok && view.len <= pack_max;
    char *base = view.buf; /* the lowest byte: the strides are positive */
    Py_ssize_t nbytes = view.len;
    PyBuffer_Release(&view); /* the array itself keeps the memory */
    out->nbytes = nbytes;
    out->datatype = NULL;
    if (!ok)
        return 0;
    if (!packs) { /* in place */
        PyObject *datatype = strided_datatype(&layout);
        if (datatype == NULL)
            return 0;
        out->address = base;
        out->count = 1;
        out->datatype = datatype;
        out->keep = Py_NewRef(tensor);
        return 1;
    }
    int size_class;
    char *packed = pool_lease(nbytes, &size_class);
    PackedObject *hook = packed != NULL ? PyObject_New(PackedObject, &Packed_Type) : NULL;
    if (hook == NULL) {
        if (packed != NULL)
            pool_return(packed, size_class);
        return -1;
    }
    hook->packed = packed;
    hook->size_class = size_class;
    hook->array = receive ? Py_NewRef(tensor) : NULL;
    hook->base = base;
    hook->layout = layout;
    if (!receive) /* packed now: the array may change once the call returns */
        strided_copy(base, &layout, packed, 1);
    out->address = packed;
    out->count = (int)nbytes;
    out->keep = Py_NewRef((PyObject *)hook); /* the hook holds the buffer until it gives it back */
    out->after = (PyObject *)hook;
    return 1;
}

/* Resolve ``tensor`` for the lean path: 1 and ``out`` filled, or 0 when the op needs the Python path
 * (``*taken`` then holds a resolved buffer to give back with ``release``, or NULL), or -1 on error. */
enum { STRIDED_HAND, STRIDED_RESOLVE, STRIDED_IN_C }; /* what lean_buffer does with a strided numpy array */

static int
lean_buffer(PyObject *tensor, int receive, PyObject *what, Buffer *out, PyObject **taken, int strided)
{
    Py_buffer view;
    *taken = NULL;
    out->after = NULL;
    if (Py_TYPE(tensor) == (PyTypeObject *)ndarray) { /* buffers._lean_numpy's contiguous case, in C */
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (receive ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(tensor, &view, flags) == 0) {
            int plain = view.len <= INT_MAX && (view.format == NULL || strchr(view.format, 'O') == NULL);
            out->address = view.buf;
            out->count = (int)view.len;
            out->nbytes = view.len;
            PyBuffer_Release(&view); /* the array itself keeps the memory */
            if (!plain)
                return 0;
            out->datatype = NULL;
            out->keep = Py_NewRef(tensor);
            return 1;
        }
        if (clear_error() < 0)
            return -1;
        if (strided == STRIDED_HAND)
            return 0;
        if (strided == STRIDED_IN_C) {
            int r = strided_buffer(tensor, receive, out);
            if (r != 0)
                return r;
        }
        /* packed, or read-only where it is written: resolved below, once, as the Python path resolves it */
    }
    if (tensor == Py_None)
        return 0;
    PyObject *resolver = PyDict_GetItemWithError(resolvers, (PyObject *)Py_TYPE(tensor));
    if (resolver == NULL && PyErr_Occurred())
        return -1;
    resolver = Py_NewRef(resolver != NULL ? resolver : resolve); /* a resolver may clear the dict it came from */
    PyObject *resolved = PyObject_CallFunctionObjArgs(resolver, tensor, receive ? Py_True : Py_False, what, NULL);
    Py_DECREF(resolver);
    if (resolved == NULL)
        return clear_error(); /* the Python path resolves it again and raises the same error, with its wording */
    /* (spec, nbytes, keep, after) with spec [buffer, count, datatype] */
    if (!PyTuple_CheckExact(resolved) || PyTuple_GET_SIZE(resolved) != 4) {
        Py_DECREF(resolved);
        return 0;
    }
    PyObject *spec = PyTuple_GET_ITEM(resolved, 0);
    if (PyTuple_GET_ITEM(resolved, 3) != Py_None || !PyList_CheckExact(spec) || PyList_GET_SIZE(spec) != 3 ||
        !PyLong_CheckExact(PyList_GET_ITEM(spec, 1)) ||
        !PyObject_TypeCheck(PyList_GET_ITEM(spec, 2), &PyMPIDatatype_Type) ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(resolved, 1))) {
        *taken = resolved; /* staged or packed: an after-hook to run, or a buffer to give back */
        return 0;
    }
    long count = PyLong_AsLong(PyList_GET_ITEM(spec, 1));
    Py_ssize_t nbytes = PyLong_AsSsize_t(PyTuple_GET_ITEM(resolved, 1));
    if (count < 0 || count > INT_MAX || nbytes < 0 ||
        PyObject_GetBuffer(PyList_GET_ITEM(spec, 0), &view, receive ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        if (!PyErr_Occurred()) {
            *taken = resolved; /* a count over 2**31: mpi4py's large-count calls post it */
            return 0;
        }
        Py_DECREF(resolved);
        return clear_error();
    }
    out->address = view.buf;
    PyBuffer_Release(&view); /* the resolved tuple keeps the tensor and the spec alive */
    out->count = (int)count;
    out->datatype = PyList_GET_ITEM(spec, 2);
    if (*PyMPIDatatype_Get(out->datatype) == MPI_BYTE)
        out->datatype = NULL;
    out->nbytes = nbytes;
    out->keep = resolved;
    return 1;
}

/* For a buffer resolved here that the lean path does not post (staged, packed, a large count): the Work that
 * ``ops._post`` would make of it, posted by Work.__init__ (``taken`` stolen), so that it is not resolved twice. */
static PyObject *
python_work(PyObject *group, int receive, int peer, int tag, PyObject *taken, PyObject *what)
{
    PyObject *work =
        PyObject_CallFunction(Work_type, "OOiiOO", group, receive ? Py_True : Py_False, peer, tag, taken, what);
    Py_DECREF(taken);
    return work;
}

static int
give_back(PyObject *taken)
{
    if (taken == NULL)
        return 0;
    PyObject *list = PyList_New(1);
    if (list == NULL) {
        Py_DECREF(taken);
        return -1;
    }
    PyList_SET_ITEM(list, 0, taken);
    PyObject *r = PyObject_CallOneArg(release, list);
    Py_DECREF(list);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static PyObject *
mpi_error(int code)
{
    return PyObject_CallFunction(mpi_exception, "i", code);
}

/* Raise ``error`` (an exception instance) with ``cause`` as its __cause__ (both stolen). */
static void
raise_with_cause(PyObject *error, PyObject *cause)
{
    if (error == NULL) {
        Py_XDECREF(cause);
        return;
    }
    if (cause != NULL)
        PyException_SetCause(error, cause);
    PyErr_SetObject((PyObject *)Py_TYPE(error), error);
    Py_DECREF(error);
}

static PyObject *
new_status(MPI_Status *status)
{
    return PyMPIStatus_New(status);
}

/* Call a Python method ``reference`` (the one a compiled method stands in for) on ``self`` with a call's arguments. */
static PyObject *
call_reference(PyObject *reference, PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (reference == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the compiled engine is not set up");
        return NULL;
    }
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8], **stack = total < 8 ? small : PyMem_Malloc((total + 1) * sizeof(PyObject *));
    if (stack == NULL)
        return PyErr_NoMemory();
    stack[0] = self;
    for (Py_ssize_t i = 0; i < total; i++)
        stack[i + 1] = args[i];
    PyObject *result = PyObject_Vectorcall(reference, stack, nargs + 1, kwnames);
    if (stack != small)
        PyMem_Free(stack);
    return result;
}

/* --- WorkBase ---------------------------------------------------------------------------------- */

typedef struct BatchObject BatchObject;

typedef struct {
    PyObject_HEAD
    PyObject *after, *exception, *group, *keep, *nbytes, *peer, *receive, *request, *source, *state, *tag, *posted;
    BatchObject *owner; /* borrowed: the lean batch that holds this op while its fields are unfilled, or NULL */
} WorkObject;

#define WORK_FIELDS(X) \
    X(after) X(exception) X(group) X(keep) X(nbytes) X(peer) X(receive) X(request) X(source) X(state) X(tag) X(posted)

static int batch_fill(BatchObject *self, Py_ssize_t posted);

/* A Work a lean batch still holds has its fields filled in (with every other op of that batch) before any is read. */
static int
work_filled(WorkObject *self)
{
    if (self->owner == NULL)
        return 0;
    PyObject *owner = Py_NewRef((PyObject *)self->owner); /* the batch lives until its Works are filled */
    int r = batch_fill(self->owner, -1);
    Py_DECREF(owner);
    return r;
}

typedef struct {
    const char *name;
    Py_ssize_t offset;
} Field;

#define FIELD(f) {"_" #f, offsetof(WorkObject, f)},
static Field work_field_list[] = {WORK_FIELDS(FIELD)};
#undef FIELD
#define WORK_FIELD_COUNT (sizeof work_field_list / sizeof work_field_list[0])

static PyObject *
work_get(WorkObject *self, void *closure)
{
    Field *field = closure;
    if (work_filled(self) < 0)
        return NULL;
    PyObject *value = *(PyObject **)((char *)self + field->offset);
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, field->name);
        return NULL;
    }
    return Py_NewRef(value);
}

static int
work_set(WorkObject *self, PyObject *value, void *closure)
{
    Field *field = closure;
    if (work_filled(self) < 0)
        return -1;
    Py_XSETREF(*(PyObject **)((char *)self + field->offset), Py_XNewRef(value));
    return 0;
}

static PyGetSetDef work_getset[WORK_FIELD_COUNT + 1];

/* The fields as attributes: ``_after``, ..., and ``posted`` (public). */
static void
work_getset_init(void)
{
    for (size_t i = 0; i < WORK_FIELD_COUNT; i++) {
        Field *field = &work_field_list[i];
        if (strcmp(field->name, "_posted") == 0)
            field->name = "posted";
        work_getset[i] =
            (PyGetSetDef){field->name, (getter)work_get, (setter)work_set,
                          i == WORK_FIELD_COUNT - 1 ? "When the op was posted (time.monotonic())." : NULL, field};
    }
}

static int
work_traverse(WorkObject *self, visitproc visit, void *arg)
{
#define VISIT(f) Py_VISIT(self->f);
    WORK_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int
work_clear(WorkObject *self)
{
#define CLEAR(f) Py_CLEAR(self->f);
    WORK_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void
work_dealloc(WorkObject *self)
{
    PyObject_GC_UnTrack(self);
    work_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self); /* a heap subclass's type is released by its own dealloc */
}

static int
state_is(PyObject *value, long which)
{
    return value != NULL && PyLong_CheckExact(value) && PyLong_AsLong(value) == which;
}

/* A handle dropped while pending is watched no more (``watchdog.untrack``, where the watchdog is on), as ``work.drop``
 * leaves the Python handles: it is finished at a later post, and named at exit if still pending then.  0, or -1 with
 * an error. */
static int
unwatch(PyObject *handle)
{
    PyObject *on = PyDict_GetItemWithError(watchdog_dict, s_active);
    if (on != Py_True)
        return on == NULL && PyErr_Occurred() ? -1 : 0;
    PyObject *untrack = PyDict_GetItemWithError(watchdog_dict, s_untrack);
    if (untrack == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "process.watchdog has no untrack");
        return -1;
    }
    PyObject *done = PyObject_CallOneArg(untrack, handle);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* A pending Work dropped without wait() is kept (with its buffer) until MPI is done with it, unwatched. */
static void
work_finalize(WorkObject *self)
{
    if (self->owner != NULL) { /* the GC may finalize a shell of a pending batch before the batch itself */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (work_filled(self) < 0)
            PyErr_WriteUnraisable(NULL);
        PyErr_Restore(type, value, tb);
    }
    if (dropped == NULL || !state_is(self->state, PENDING) || self->request == NULL ||
        !PyObject_TypeCheck(self->request, &PyMPIRequest_Type) || *PyMPIRequest_Get(self->request) == MPI_REQUEST_NULL)
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (PyList_Append(dropped, (PyObject *)self) < 0 || unwatch((PyObject *)self) < 0)
        PyErr_WriteUnraisable((PyObject *)self);
    PyErr_Restore(type, value, tb);
}

/* Call ``self.<name>(args...)``, then raise the Work's recorded exception. */
static PyObject *
work_finish_in_python(WorkObject *self, PyObject *name, int code, PyObject *status)
{
    PyObject *r;
    if (code >= 0) {
        PyObject *code_obj = PyLong_FromLong(code);
        r = code_obj ? PyObject_CallMethodObjArgs((PyObject *)self, name, code_obj, status, NULL) : NULL;
        Py_XDECREF(code_obj);
    } else
        r = PyObject_CallMethodOneArg((PyObject *)self, name, status);
    Py_DECREF(status);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    if (self->exception != NULL && self->exception != Py_None) {
        PyErr_SetObject((PyObject *)Py_TYPE(self->exception), self->exception);
        return NULL;
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(work_wait_doc, "wait($self, /, timeout=None)\n--\n\n"
                            "Block until the operation completes; raise its error if it failed. Returns True.");

static PyObject *
work_wait(WorkObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *timeout = nargs > 0 ? args[0] : Py_None;
    calls_made[C_WORK_WAIT]++;
    if (work_filled(self) < 0)
        return NULL;
    int lean = ref_work_wait != NULL && nargs <= 1 && kwnames == NULL && timeout == Py_None &&
               state_is(self->state, PENDING) && self->request != NULL &&
               (self->after == Py_None || Py_TYPE(self->after) == &Packed_Type) && self->group != NULL &&
               self->nbytes != NULL && PyLong_CheckExact(self->nbytes) &&
               PyObject_TypeCheck(self->request, &PyMPIRequest_Type) &&
               PyDict_GetItemWithError(watchdog_dict, s_active) == Py_False &&
               PyDict_GetItemWithError(validate_dict, s_single_threaded) == Py_False; /* else Python's thread rule */
    if (!lean)
        return HANDED(C_WORK_WAIT, call_reference(ref_work_wait, (PyObject *)self, args, nargs, kwnames));
    int receive = self->receive == Py_True;
    PyObject *held = Py_NewRef(self->request); /* alive while MPI writes its handle, whatever other threads do */
    MPI_Request *request = PyMPIRequest_Get(held);
    MPI_Status status;
    int code;
    blank_status(&status);
    int done = 0; /* an op already complete (a small send, often) is finished without giving up the GIL */
    code = MPI_Test(request, &done, receive ? &status : MPI_STATUS_IGNORE);
    if (code == MPI_SUCCESS && !done) {
        WaitRecord *record = wait_begin((PyObject *)self);
        Py_BEGIN_ALLOW_THREADS
        code = MPI_Wait(request, receive ? &status : MPI_STATUS_IGNORE);
        Py_END_ALLOW_THREADS
        wait_end(record);
    }
    int mine = self->request == held && state_is(self->state, PENDING) && /* not settled by another thread meanwhile */
               (self->after == Py_None || Py_TYPE(self->after) == &Packed_Type);
    Py_DECREF(held);
    if (!mine)
        return HANDED(C_WORK_WAIT, call_reference(ref_work_wait, (PyObject *)self, args, nargs, kwnames));
    if (code != MPI_SUCCESS) {
        PyObject *st = receive ? new_status(&status) : Py_NewRef(Py_None);
        return st ? work_finish_in_python(self, s_fail, code, st) : NULL;
    }
    if (receive && status.MPI_SOURCE != MPI_PROC_NULL) {
        if (received_bytes(&status) != PyLong_AsSsize_t(self->nbytes)) { /* Work.complete words the size error */
            PyObject *st = new_status(&status);
            return st ? work_finish_in_python(self, s_complete, -1, st) : NULL;
        }
        PyObject *global_of = PyObject_GetAttr(self->group, s_global_of);
        PyObject *source = global_of ? PySequence_GetItem(global_of, status.MPI_SOURCE) : NULL;
        Py_XDECREF(global_of);
        if (source == NULL)
            return NULL;
        Py_XSETREF(self->source, source);
    }
    Py_XSETREF(self->request, Py_NewRef(request_null));
    Py_XSETREF(self->state, Py_NewRef(done_obj));
    Py_XSETREF(self->keep, Py_NewRef(Py_None));
    if (self->after != Py_None && Py_TYPE(self->after) == &Packed_Type) { /* packed: copied out, buffer back */
        PyObject *hook = self->after;
        self->after = Py_NewRef(Py_None);
        int r = packed_finish((PackedObject *)hook, 1);
        Py_DECREF(hook);
        if (r < 0)
            return NULL;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef work_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))work_wait, METH_FASTCALL | METH_KEYWORDS, work_wait_doc},
    {NULL},
};

static PyTypeObject WorkBase_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorplay_p2p._src.engine._accel.WorkBase",
    .tp_doc = "The fields of a Work, and its lean wait().",
    .tp_basicsize = sizeof(WorkObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)work_dealloc,
    .tp_traverse = (traverseproc)work_traverse,
    .tp_clear = (inquiry)work_clear,
    .tp_finalize = (destructor)work_finalize,
    .tp_getset = work_getset,
    .tp_methods = work_methods,
};

/* A Work for an op about to be posted here, with the fields Work.__init__ sets (``buffer->keep`` taken over); it
 * is not pending until ``post_work`` has posted it into its request. */
static WorkObject *
new_work(PyObject *group, int receive, int peer, int tag, Buffer *buffer)
{
    PyTypeObject *tp = (PyTypeObject *)Work_type;
    WorkObject *w = (WorkObject *)tp->tp_alloc(tp, 0);
    if (w == NULL)
        return NULL;
    w->after = buffer->after != NULL ? buffer->after : Py_NewRef(Py_None); /* a packed message's hook */
    buffer->after = NULL;
    w->exception = Py_NewRef(Py_None);
    w->group = Py_NewRef(group);
    w->keep = buffer->keep;
    buffer->keep = NULL;
    w->receive = Py_NewRef(receive ? Py_True : Py_False);
    w->state = Py_NewRef(failed_obj);
    w->request = PyMPIRequest_New(MPI_REQUEST_NULL);
    w->nbytes = PyLong_FromSsize_t(buffer->nbytes);
    w->peer = PyLong_FromLong(peer);
    w->source = PyLong_FromLong(-1);
    w->tag = PyLong_FromLong(tag);
    w->posted = PyFloat_FromDouble(monotonic());
    if (w->request == NULL || w->nbytes == NULL || w->peer == NULL || w->source == NULL || w->tag == NULL ||
        w->posted == NULL) {
        Py_DECREF(w);
        return NULL;
    }
    return w;
}

/* Post ``w``'s op into its request: MPI's error code (then ``w`` stays not pending). */
static int
post_work(WorkObject *w, PyObject *comm, Buffer *buffer, int peer, int tag)
{
    MPI_Request *request = PyMPIRequest_Get(w->request);
    MPI_Datatype datatype = datatype_of(buffer);
    MPI_Comm handle = *PyMPIComm_Get(comm);
    int code = w->receive == Py_True ? MPI_Irecv(buffer->address, buffer->count, datatype, peer, tag, handle, request)
                                     : MPI_Isend(buffer->address, buffer->count, datatype, peer, tag, handle, request);
    if (code == MPI_SUCCESS)
        Py_XSETREF(w->state, Py_NewRef(pending_obj));
    return code;
}

/* --- BatchBase --------------------------------------------------------------------------------- */

/* A batch posted here is a list of Works that are shells (no field set, ``owner`` this batch) while the batch holds
 * its ops in C arrays: its lean wait() completes them there.  The first read of a shell's field, of ``_works``, or
 * a wait the lean path does not take fills every shell in (``batch_fill``), and the Python methods take over. */

typedef struct {
    int receive, peer, tag;
    Py_ssize_t nbytes;
    PyObject *keep;   /* owned while the batch holds its ops in C */
    WorkObject *work; /* owned: the op's Work, whatever the list holds */
} LeanOp;

struct BatchObject {
    PyListObject list;
    PyObject *group, *state, *works, *posted;
    Py_ssize_t n; /* ops posted here (0: a batch built by Python code) */
    int lean;     /* the ops are in ``reqs`` and ``info``, their Works shells */
    int busy;     /* a thread is in MPI_Waitall on ``reqs`` (without the GIL) */
    MPI_Request *reqs;
    LeanOp *info;
    MPI_Request small_reqs[SMALL];
    LeanOp small_info[SMALL];
};

#define BATCH_FIELDS(X) X(group) X(state) X(works) X(posted)

static void
batch_drop_keeps(BatchObject *self)
{
    if (self->info == NULL)
        return;
    for (Py_ssize_t i = 0; i < self->n; i++)
        Py_CLEAR(self->info[i].keep);
}

/* The fields of one op's Work that ``batch_fill`` makes before it changes anything. */
typedef struct {
    PyObject *nbytes, *peer, *tag, *source, *request;
} Made;

static void
made_clear(Made *made, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_CLEAR(made[i].nbytes);
        Py_CLEAR(made[i].peer);
        Py_CLEAR(made[i].tag);
        Py_CLEAR(made[i].source);
        Py_CLEAR(made[i].request);
    }
}

/* Fill the shells in: each Work gets its op's fields and outcome, a pending one its own request and buffer (the ops
 * from ``posted`` on, when a post failed, were never posted: not pending).  ``posted`` -1: every op.  From here on
 * Python code holds the batch (``_works``).  All or nothing: everything is made first, and a failure changes
 * nothing (the shells stay shells, the requests stay here).  The caller holds a reference to the batch: code that
 * the allocations run (the GC's) may let go of every other one. */
static int
batch_fill(BatchObject *self, Py_ssize_t posted)
{
    if (!self->lean)
        return 0;
    if (self->busy) { /* worded by Python */
        PyObject *error = PyObject_CallNoArgs(busy_error);
        if (error != NULL)
            raise_with_cause(error, NULL);
        return -1;
    }
    if (self->group == NULL || self->posted == NULL || self->state == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a field of this BatchWork was deleted");
        return -1;
    }
    Py_ssize_t n = self->n;
    if (posted < 0)
        posted = n;
    int pending = state_is(self->state, PENDING);
    Made small[SMALL], *made = n <= SMALL ? small : PyMem_Calloc(n, sizeof(Made));
    if (made == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(made, 0, n * sizeof(Made));
    PyObject *works = PyTuple_New(n);
    PyObject *global_of = pending ? NULL : PyObject_GetAttr(self->group, s_global_of);
    int failed = works == NULL || (!pending && global_of == NULL);
    for (Py_ssize_t i = 0; i < n && !failed; i++) {
        LeanOp *op = &self->info[i];
        Made *m = &made[i];
        m->nbytes = PyLong_FromSsize_t(op->nbytes);
        m->peer = PyLong_FromLong(op->peer);
        m->tag = PyLong_FromLong(op->tag);
        m->source = !pending && op->receive ? PySequence_GetItem(global_of, op->peer) : PyLong_FromLong(-1);
        m->request = pending && i < posted ? PyMPIRequest_New(MPI_REQUEST_NULL) : Py_NewRef(request_null);
        failed = m->nbytes == NULL || m->peer == NULL || m->tag == NULL || m->source == NULL || m->request == NULL;
    }
    Py_XDECREF(global_of);
    if (failed || !self->lean) { /* an error; or filled meanwhile, by code the allocations ran */
        made_clear(made, n);
        Py_XDECREF(works);
        if (made != small)
            PyMem_Free(made);
        return failed ? -1 : 0;
    }
    /* from here on nothing allocates, fails or runs Python code until every Work is whole */
    self->lean = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        LeanOp *op = &self->info[i];
        WorkObject *w = op->work;
        Made *m = &made[i];
        int live = pending && i < posted;
        w->owner = NULL;
        PyTuple_SET_ITEM(works, i, Py_NewRef((PyObject *)w));
        w->after = Py_NewRef(Py_None);
        w->exception = Py_NewRef(Py_None);
        w->group = Py_NewRef(self->group);
        w->keep = pending && op->keep ? Py_NewRef(op->keep) : Py_NewRef(Py_None);
        w->receive = Py_NewRef(op->receive ? Py_True : Py_False);
        w->state = Py_NewRef(live ? pending_obj : pending ? failed_obj : done_obj);
        w->posted = Py_NewRef(self->posted);
        w->nbytes = m->nbytes;
        w->peer = m->peer;
        w->tag = m->tag;
        w->source = m->source;
        w->request = m->request;
        if (live) { /* the Work's request holds it now */
            *PyMPIRequest_Get(w->request) = self->reqs[i];
            self->reqs[i] = MPI_REQUEST_NULL;
        }
        if (!PyObject_GC_IsTracked((PyObject *)w))
            PyObject_GC_Track((PyObject *)w); /* a shell, with no references, is not tracked */
    }
    if (made != small)
        PyMem_Free(made);
    Py_XSETREF(self->works, works);
    batch_drop_keeps(self); /* the Works keep them now */
    return 0;
}

/* How many of the references to ``w`` this batch holds: its own, and each place in the list. */
static Py_ssize_t
batch_references(BatchObject *self, Py_ssize_t i)
{
    PyObject *w = (PyObject *)self->info[i].work;
    Py_ssize_t size = PyList_GET_SIZE(self), count = 1;
    if (size == self->n && PyList_GET_ITEM(self, i) == w)
        return 2; /* the list as the batch made it (its items are distinct) */
    for (Py_ssize_t j = 0; j < size; j++)
        count += PyList_GET_ITEM(self, j) == w;
    return count;
}

/* Whether ``o`` may have weak references (a Work has its Python class's ``__weakref__`` slot, for the watchdog): a
 * shell that may is never reused, since a weak reference to it would then find another op's Work. */
static int
weakly_referenced(PyObject *o)
{
    Py_ssize_t offset = Py_TYPE(o)->tp_weaklistoffset;
    if (offset <= 0) /* none, or kept where this cannot look (a managed weak list): taken as there */
        return offset != 0;
    return *(PyObject **)((char *)o + offset) != NULL;
}

/* Shells no one else holds, kept for the next batches instead of being freed and made again. */
#define SHELLS 64
static WorkObject *shells[SHELLS];
static int spare_shells = 0;

/* A shell for a lean batch's op (a new reference). */
static WorkObject *
new_shell(void)
{
    if (spare_shells > 0)
        return shells[--spare_shells];
    PyTypeObject *tp = (PyTypeObject *)Work_type;
    WorkObject *w = (WorkObject *)tp->tp_alloc(tp, 0);
    if (w != NULL)
        PyObject_GC_UnTrack(w); /* no references while a shell: the GC need not see it (filling tracks it) */
    return w;
}

/* Before the batch lets go of its Works: shells held elsewhere too are filled in; the others are kept as spares
 * (untracked by the GC, never finalized) or die with the batch.  Runs in dealloc and tp_clear: the exception being
 * raised, if any, is kept. */
static void
batch_release_works(BatchObject *self)
{
    if (self->info == NULL)
        return;
    int shared = 0;
    if (self->lean) {
        for (Py_ssize_t i = 0; i < self->n && !shared; i++)
            shared = Py_REFCNT(self->info[i].work) > batch_references(self, i);
        if (shared) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            if (batch_fill(self, -1) < 0)
                PyErr_WriteUnraisable(NULL);
            PyErr_Restore(type, value, tb);
        }
    }
    for (Py_ssize_t i = 0; i < self->n; i++) {
        WorkObject *w = self->info[i].work;
        if (w == NULL)
            continue;
        if (self->lean && !shared && w->owner == self && spare_shells < SHELLS &&
            Py_TYPE(w) == (PyTypeObject *)Work_type && !PyObject_GC_IsFinalized((PyObject *)w) &&
            !weakly_referenced((PyObject *)w)) {
            if (PyObject_GC_IsTracked((PyObject *)w))
                PyObject_GC_UnTrack(w);
            shells[spare_shells++] = w; /* this reference moves there; the list's go with the list */
            self->info[i].work = NULL;
        }
        w->owner = NULL;
    }
    self->lean = 0;
    for (Py_ssize_t i = 0; i < self->n; i++)
        Py_CLEAR(self->info[i].work);
}

static int
batch_traverse(BatchObject *self, visitproc visit, void *arg)
{
    if (PyList_Type.tp_traverse((PyObject *)self, visit, arg) < 0)
        return -1;
#define VISIT(f) Py_VISIT(self->f);
    BATCH_FIELDS(VISIT)
#undef VISIT
    if (self->info != NULL)
        for (Py_ssize_t i = 0; i < self->n; i++) {
            Py_VISIT(self->info[i].keep);
            Py_VISIT(self->info[i].work);
        }
    return 0;
}

static int
batch_clear(BatchObject *self)
{
    batch_release_works(self);
#define CLEAR(f) Py_CLEAR(self->f);
    BATCH_FIELDS(CLEAR)
#undef CLEAR
    batch_drop_keeps(self);
    return PyList_Type.tp_clear((PyObject *)self);
}

static void
batch_free_arrays(BatchObject *self)
{
    if (self->reqs != NULL && self->reqs != self->small_reqs)
        PyMem_Free(self->reqs);
    if (self->info != NULL && self->info != self->small_info)
        PyMem_Free(self->info);
    self->reqs = NULL;
    self->info = NULL;
    self->n = 0;
}

static void
batch_dealloc(BatchObject *self)
{
    PyObject_GC_UnTrack(self);
    batch_release_works(self);
#define CLEAR(f) Py_CLEAR(self->f);
    BATCH_FIELDS(CLEAR)
#undef CLEAR
    batch_drop_keeps(self);
    batch_free_arrays(self);
    PyList_Type.tp_dealloc((PyObject *)self); /* the items, then tp_free; a heap subclass's type is released by its
                                                  own dealloc */
}

/* A pending batch dropped while it holds its ops: each Work takes its own, and a dropped pending Work is kept
 * until MPI is done with it (``work_finalize``). */
static void
batch_finalize(BatchObject *self)
{
    if (!self->lean || !state_is(self->state, PENDING))
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (batch_fill(self, -1) < 0)
        PyErr_WriteUnraisable((PyObject *)self);
    PyErr_Restore(type, value, tb);
}

static PyObject *
get_works(BatchObject *self, void *closure)
{
    if (batch_fill(self, -1) < 0)
        return NULL;
    if (self->works == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_works");
        return NULL;
    }
    return Py_NewRef(self->works);
}

static int
set_works(BatchObject *self, PyObject *value, void *closure)
{
    if (batch_fill(self, -1) < 0)
        return -1;
    Py_XSETREF(self->works, Py_XNewRef(value));
    return 0;
}

/* ``_lean``: the ops of a pending batch that the C code holds, as (receive, group peer, tag, nbytes), read without
 * filling the shells (a signal's report reads them while another thread waits on the batch); None otherwise. */
static PyObject *
get_lean(BatchObject *self, void *closure)
{
    if (!self->lean || !state_is(self->state, PENDING))
        Py_RETURN_NONE;
    PyObject *ops = PyTuple_New(self->n);
    if (ops == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        LeanOp *op = &self->info[i];
        PyObject *item = Py_BuildValue("(Oiin)", op->receive ? Py_True : Py_False, op->peer, op->tag, op->nbytes);
        if (item == NULL) {
            Py_DECREF(ops);
            return NULL;
        }
        PyTuple_SET_ITEM(ops, i, item);
    }
    return ops;
}

static PyGetSetDef batch_getset[] = {
    {"_works", (getter)get_works, (setter)set_works, NULL, NULL},
    {"_lean", (getter)get_lean, NULL, NULL, NULL},
    {NULL},
};

static PyMemberDef batch_members[] = {
    {"_group", T_OBJECT_EX, offsetof(BatchObject, group), 0, NULL},
    {"_state", T_OBJECT_EX, offsetof(BatchObject, state), 0, NULL},
    {"posted", T_OBJECT_EX, offsetof(BatchObject, posted), 0, "When the batch was posted (time.monotonic())."},
    {NULL},
};

/* After a Waitall that failed (``code``) or a receive of the wrong size: the Python methods finish it. */
static PyObject *
batch_finish_in_python(BatchObject *self, MPI_Status *statuses, int code)
{
    Py_ssize_t n = self->n;
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *st = new_status(&statuses[i]);
        if (st == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, st);
    }
    /* the requests MPI completed are MPI_REQUEST_NULL in ``reqs`` now; the others are still pending */
    if (batch_fill(self, -1) < 0) {
        Py_DECREF(list);
        return NULL;
    }
    PyObject *exc = code != MPI_SUCCESS ? mpi_error(code) : Py_NewRef(Py_None);
    PyObject *r = exc ? PyObject_CallMethodObjArgs((PyObject *)self, s_finish, list, exc, NULL) : NULL;
    Py_XDECREF(exc);
    Py_DECREF(list);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(batch_wait_doc,
             "wait($self, /, timeout=None)\n--\n\n"
             "Complete every op (one ``Waitall``); raise the first error if any op failed. Returns True.");

static PyObject *
batch_wait(BatchObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    calls_made[C_BATCH_WAIT]++;
    if (!(self->lean && !self->busy && nargs <= 1 && kwnames == NULL && (nargs == 0 || args[0] == Py_None) &&
          state_is(self->state, PENDING) && PyDict_GetItemWithError(validate_dict, s_single_threaded) == Py_False))
        return self->lean && state_is(self->state, DONE) && nargs == 0 && kwnames == NULL
                   ? Py_NewRef(Py_True) /* completed here: every op succeeded */
                   : HANDED(C_BATCH_WAIT, call_reference(ref_batch_wait, (PyObject *)self, args, nargs, kwnames));
    Py_ssize_t n = self->n;
    MPI_Status small[SMALL], *statuses = n <= SMALL ? small : PyMem_Malloc(n * sizeof(MPI_Status));
    if (statuses == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++)
        blank_status(&statuses[i]);
    int done = 0; /* ops already complete are finished without giving up the GIL */
    int code = MPI_Testall((int)n, self->reqs, &done, statuses);
    Py_INCREF(self); /* alive, with its arrays, while MPI writes them */
    if (code == MPI_SUCCESS && !done) {
        self->busy = 1;
        WaitRecord *record = wait_begin((PyObject *)self);
        Py_BEGIN_ALLOW_THREADS
        code = MPI_Waitall((int)n, self->reqs, statuses);
        Py_END_ALLOW_THREADS
        wait_end(record);
        self->busy = 0;
    }
    PyObject *result = NULL;
    if (code != MPI_SUCCESS) {
        result = batch_finish_in_python(self, statuses, code);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (self->info[i].receive && received_bytes(&statuses[i]) != self->info[i].nbytes) {
            result = batch_finish_in_python(self, statuses, MPI_SUCCESS); /* Work.complete words the error */
            goto done;
        }
    }
    Py_XSETREF(self->state, Py_NewRef(done_obj));
    batch_drop_keeps(self); /* release the buffers */
    result = Py_NewRef(Py_True);
done:
    Py_DECREF(self);
    if (statuses != small)
        PyMem_Free(statuses);
    return result;
}

static PyMethodDef batch_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))batch_wait, METH_FASTCALL | METH_KEYWORDS, batch_wait_doc},
    {NULL},
};

static PyTypeObject BatchBase_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorplay_p2p._src.engine._accel.BatchBase",
    .tp_doc = "A list of Works: the fields of a BatchWork, its ops in C while its Works are shells, and its lean "
              "wait().",
    .tp_basicsize = sizeof(BatchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_traverse = (traverseproc)batch_traverse,
    .tp_clear = (inquiry)batch_clear,
    .tp_finalize = (destructor)batch_finalize,
    .tp_members = batch_members,
    .tp_getset = batch_getset,
    .tp_methods = batch_methods,
};

/* --- OpBase: P2POp's construction -------------------------------------------------------------- */

static int
small_rank(PyObject *v, long high)
{
    if (!PyLong_CheckExact(v))
        return -1;
    int overflow;
    long x = PyLong_AsLongAndOverflow(v, &overflow);
    return !overflow && x >= 0 && x <= high ? (int)x : -1;
}

static PyObject *
op_fields(PyTypeObject *type, PyObject *op, PyObject *tensor, PyObject *peer, PyObject *group, PyObject *tag,
          PyObject *group_peer)
{
    PyObject *self = type->tp_alloc(type, 6);
    if (self == NULL)
        return NULL;
    PyTuple_SET_ITEM(self, 0, Py_NewRef(op));
    PyTuple_SET_ITEM(self, 1, Py_NewRef(tensor));
    PyTuple_SET_ITEM(self, 2, Py_NewRef(peer));
    PyTuple_SET_ITEM(self, 3, Py_NewRef(group));
    PyTuple_SET_ITEM(self, 4, Py_NewRef(tag));
    PyTuple_SET_ITEM(self, 5, Py_NewRef(group_peer));
    return self;
}

/* P2POp(op, tensor, peer=None, group=None, tag=0, group_peer=None): the arguments, or 0 when they are not a form
 * parsed here (the reference then parses them, and words any error). */
static int
op_args(PyObject *args, PyObject *kwds, PyObject **out)
{
    static const char *names[6] = {"op", "tensor", "peer", "group", "tag", "group_peer"};
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    out[0] = out[1] = out[4] = NULL;
    out[2] = out[3] = out[5] = Py_None;
    if (nargs > 6)
        return 0;
    for (Py_ssize_t i = 0; i < nargs; i++)
        out[i] = PyTuple_GET_ITEM(args, i);
    if (kwds != NULL) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(kwds, &pos, &key, &value)) {
            int slot = -1;
            for (int j = 0; j < 6; j++)
                if (PyUnicode_CompareWithASCIIString(key, names[j]) == 0)
                    slot = j;
            if (slot < nargs)
                return 0;
            out[slot] = value;
        }
    }
    return out[0] != NULL && out[1] != NULL;
}

static PyObject *
op_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *a[6];
    calls_made[C_OP]++;
    if (ref_new_op == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the compiled engine is not set up");
        return NULL;
    }
    if (op_args(args, kwds, a) && (a[0] == lean_isend_obj || a[0] == lean_irecv_obj) && a[3] == Py_None &&
        a[5] == Py_None && small_rank(a[2], world_size - 1) >= 0 && (a[4] == NULL || small_rank(a[4], tag_ub) >= 0) &&
        group_live(world)) { /* ops.P2POp.__new__'s common case, in C */
        PyObject *zero = a[4] == NULL ? PyLong_FromLong(0) : NULL;
        PyObject *tag = a[4] ? a[4] : zero;
        PyObject *self = tag ? op_fields(type, a[0], a[1], a[2], Py_None, tag, a[2]) : NULL;
        Py_XDECREF(zero);
        return self;
    }
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    PyObject *full = PyTuple_New(nargs + 1);
    if (full == NULL)
        return NULL;
    PyTuple_SET_ITEM(full, 0, Py_NewRef((PyObject *)type));
    for (Py_ssize_t i = 0; i < nargs; i++)
        PyTuple_SET_ITEM(full, i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
    PyObject *self = HANDED(C_OP, PyObject_Call(ref_new_op, full, kwds));
    Py_DECREF(full);
    return self;
}

static PyTypeObject OpBase_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorplay_p2p._src.engine._accel.OpBase",
    .tp_doc = "The tuple under a P2POp, built with its common case checked in C.",
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = op_new,
};

PyDoc_STRVAR(new_op_doc, "new_op($module, cls, fields, /)\n--\n\n"
                         "A ``cls`` instance holding the six checked ``fields`` of a P2POp.");

static PyObject *
new_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyType_Check(args[0]) || !PyType_IsSubtype((PyTypeObject *)args[0], &OpBase_Type) ||
        !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != 6) {
        PyErr_SetString(PyExc_TypeError, "new_op(cls, fields): an OpBase subclass and a 6-tuple");
        return NULL;
    }
    PyObject *f = args[1];
    return op_fields((PyTypeObject *)args[0], PyTuple_GET_ITEM(f, 0), PyTuple_GET_ITEM(f, 1), PyTuple_GET_ITEM(f, 2),
                     PyTuple_GET_ITEM(f, 3), PyTuple_GET_ITEM(f, 4), PyTuple_GET_ITEM(f, 5));
}

/* --- batch_isend_irecv --------------------------------------------------------------------------- */

typedef struct {
    char *low;
    Py_ssize_t count;
    Py_ssize_t index;
    int receive;
} Span;

/* buffers.check_batch for contiguous buffers: the first overlapping pair in the same sorted order, or (-1, -1). */
static void
first_overlap(Span *spans, Py_ssize_t n, Py_ssize_t *first, Py_ssize_t *second)
{
    *first = *second = -1;
    for (Py_ssize_t i = 1; i < n; i++) { /* insertion sort by (low, count, index) */
        Span s = spans[i];
        Py_ssize_t j = i;
        while (j > 0 && (spans[j - 1].low > s.low || (spans[j - 1].low == s.low && spans[j - 1].count > s.count))) {
            spans[j] = spans[j - 1];
            j--;
        }
        spans[j] = s;
    }
    for (Py_ssize_t a = 0; a < n; a++)
        for (Py_ssize_t b = a + 1; b < n; b++) {
            if (spans[b].low >= spans[a].low + spans[a].count)
                break;
            if (spans[b].count && (spans[a].receive || spans[b].receive)) {
                Py_ssize_t i = spans[a].index, j = spans[b].index;
                *first = i < j ? i : j;
                *second = i < j ? j : i;
                return;
            }
        }
}

typedef struct {
    Buffer buffer;
    int receive, peer, tag;
    PyObject *taken; /* owned: the resolved buffer of an op the Python path posts (staged, packed, strided), or NULL */
} Posting;

/* Let go of the first ``n`` ops' buffers (the resolved ones given back): 0, or -1 with an error. */
static int
discard(Posting *ops, Py_ssize_t n)
{
    int r = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_CLEAR(ops[i].buffer.keep);
        PyObject *taken = ops[i].taken;
        ops[i].taken = NULL;
        if (taken != NULL && give_back(taken) < 0)
            r = -1;
    }
    return r;
}

/* A batch with an op the engine does not post itself (staged, packed, a derived datatype): every op as resolved
 * here, handed to the Python path's ``post_resolved``, which checks them across and posts one BatchWork, so that
 * nothing is resolved twice.  The ops' buffers are the callee's (released on its error) or given back here. */
static PyObject *
post_resolved_batch(PyObject *list, PyObject *pg, Posting *ops, Py_ssize_t n)
{
    PyObject *infos = PyList_New(n), *resolved = PyList_New(0);
    Py_ssize_t i = 0;
    for (; infos != NULL && resolved != NULL && i < n; i++) {
        Posting *op = &ops[i];
        PyObject *entry = op->taken;
        op->taken = NULL;
        if (entry == NULL && PyTuple_CheckExact(op->buffer.keep)) /* resolved by a resolver, as it is */
            entry = Py_NewRef(op->buffer.keep);
        else if (entry == NULL) /* a contiguous numpy array, resolved in C: its bytes */
            entry = Py_BuildValue("([OnO]nOO)", op->buffer.keep, op->buffer.nbytes, mpi_byte, op->buffer.nbytes,
                                  op->buffer.keep, Py_None);
        Py_CLEAR(op->buffer.keep);
        int added = entry != NULL && PyList_Append(resolved, entry) == 0;
        PyObject *info = added ? Py_BuildValue("(OiiO)", op->receive ? Py_True : Py_False, op->peer, op->tag,
                                               PyTuple_GET_ITEM(entry, 1))
                               : NULL;
        if (!added && entry != NULL) /* not in the list: given back on its own */
            give_back(Py_NewRef(entry));
        Py_XDECREF(entry);
        if (info == NULL)
            break;
        PyList_SET_ITEM(infos, i, info);
    }
    PyObject *result = NULL;
    if (i == n)
        result = PyObject_CallFunctionObjArgs(ref_post_resolved, list, pg, infos, resolved, NULL);
    else { /* nothing posted: what was resolved goes back */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        discard(ops + i, n - i);
        if (resolved != NULL)
            Py_XDECREF(PyObject_CallOneArg(release, resolved));
        PyErr_Restore(type, value, tb);
    }
    Py_XDECREF(infos);
    Py_XDECREF(resolved);
    return result;
}

PyDoc_STRVAR(batch_doc, "batch_isend_irecv($module, p2p_op_list)\n--\n\n"
                        "Post every op, in order, after checking them all; returns one BatchWork completed by a single "
                        "Waitall.");

static PyObject *
lean_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *list = nargs == 1 && kwnames == NULL ? args[0] : NULL;
    Py_ssize_t n = list != NULL && PyList_CheckExact(list) ? PyList_GET_SIZE(list) : 0;
    calls_made[C_BATCH]++;
    if (ref_batch == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the compiled engine is not set up");
        return NULL;
    }
    PyObject *first = n > 0 ? PyList_GET_ITEM(list, 0) : NULL;
    if (first == NULL || Py_TYPE(first) != (PyTypeObject *)Op_type || !gate())
        return HANDED(C_BATCH, PyObject_Vectorcall(ref_batch, args, nargsf, kwnames));
    PyObject *group = PyTuple_GET_ITEM(first, 3); /* the op holds it, and the ops are held below */
    PyObject *pg = group == Py_None ? world : group;
    PyObject *comm = group_comm(pg);
    if (comm == NULL)
        return HANDED(C_BATCH, PyObject_Vectorcall(ref_batch, args, nargsf, kwnames));
    Posting small[SMALL], *ops = n <= SMALL ? small : PyMem_Calloc(n, sizeof(Posting));
    Span small_spans[SMALL], *spans = n <= SMALL ? small_spans : PyMem_Calloc(n, sizeof(Span));
    PyObject *result = NULL, *held = Py_NewRef(first);
    Py_ssize_t ready = 0;
    int receives = 0, fallback = 0, resolved_here = 0;
    if (ops == NULL || spans == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (; ready < n; ready++) {
        /* a resolver runs Python code, which may change the list: read it afresh, and hold each op */
        PyObject *p2p = ready < PyList_GET_SIZE(list) ? PyList_GET_ITEM(list, ready) : NULL;
        if (p2p == NULL || Py_TYPE(p2p) != (PyTypeObject *)Op_type || PyTuple_GET_ITEM(p2p, 3) != group) {
            fallback = 1;
            break;
        }
        Posting *op = &ops[ready];
        op->receive = PyTuple_GET_ITEM(p2p, 0) == lean_irecv_obj;
        op->peer = small_rank(PyTuple_GET_ITEM(p2p, 5), INT_MAX);
        op->tag = small_rank(PyTuple_GET_ITEM(p2p, 4), INT_MAX);
        if (op->peer < 0 || op->tag < 0) { /* PROC_NULL, a non-member's op: the Python path */
            fallback = 1;
            break;
        }
        Py_INCREF(p2p);
        op->taken = NULL;
        op->buffer = (Buffer){0};
        int r =
            lean_buffer(PyTuple_GET_ITEM(p2p, 1), op->receive, s_batch_what, &op->buffer, &op->taken, STRIDED_RESOLVE);
        Py_DECREF(p2p);                               /* the buffer's keep holds the tensor */
        if (r < 0 || (r == 0 && op->taken == NULL)) { /* an error, or one the Python path words */
            fallback = r == 0;
            break;
        }
        if (r == 0 || op->buffer.datatype != NULL) { /* staged, packed or strided: resolved, for the Python path */
            resolved_here = 1;
            continue;
        }
        receives |= op->receive;
        spans[ready] = (Span){(char *)op->buffer.address, op->buffer.nbytes, ready, op->receive};
    }
    if (ready < n || PyList_GET_SIZE(list) != n) {
        if (!fallback && PyErr_Occurred()) { /* the error raised stays; the buffers go back all the same */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            if (discard(ops, ready) < 0)
                PyErr_WriteUnraisable(held);
            PyErr_Restore(type, value, tb);
        } else if (discard(ops, ready) == 0 && fallback)
            result = HANDED(C_BATCH, PyObject_Vectorcall(ref_batch, args, nargsf, kwnames));
        goto out;
    }
    if (resolved_here) {
        result = HANDED(C_BATCH, post_resolved_batch(list, pg, ops, n));
        goto out;
    }
    if (n > 1 && receives) {
        Py_ssize_t i, j;
        first_overlap(spans, n, &i, &j);
        if (i >= 0) {
            discard(ops, n);
            raise_with_cause(PyObject_CallFunction(overlap_error, "Onn", s_batch_what, i, j), NULL);
            goto out;
        }
    }
    if (reap() < 0) {
        discard(ops, n);
        goto out;
    }
    PyTypeObject *tp = (PyTypeObject *)Batch_type;
    BatchObject *batch = (BatchObject *)tp->tp_alloc(tp, 0);
    if (batch == NULL) {
        discard(ops, n);
        goto out;
    }
    batch->group = Py_NewRef(pg);
    batch->state = Py_NewRef(failed_obj); /* not pending until posted */
    batch->posted = PyFloat_FromDouble(monotonic());
    if (n <= SMALL) {
        batch->reqs = batch->small_reqs;
        batch->info = batch->small_info;
    } else {
        batch->reqs = PyMem_Malloc(n * sizeof(MPI_Request));
        batch->info = PyMem_Calloc(n, sizeof(LeanOp));
    }
    if (batch->posted == NULL || batch->reqs == NULL || batch->info == NULL) {
        discard(ops, n);
        Py_DECREF(batch);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* each op's Work, a shell until a field of one is read */
        WorkObject *w = new_shell();
        if (w == NULL || PyList_Append((PyObject *)batch, (PyObject *)w) < 0) {
            Py_XDECREF(w);
            discard(ops, n);
            Py_DECREF(batch);
            goto out;
        }
        Posting *op = &ops[i];
        w->owner = batch;
        batch->info[i] = (LeanOp){op->receive, op->peer, op->tag, op->buffer.nbytes, op->buffer.keep, w};
        op->buffer.keep = NULL;
        batch->reqs[i] = MPI_REQUEST_NULL;
        batch->n = i + 1;
    }
    batch->lean = 1;
    MPI_Comm handle = *PyMPIComm_Get(comm);
    Py_ssize_t posted = 0;
    int code = MPI_SUCCESS;
    for (; posted < n; posted++) {
        Posting *op = &ops[posted];
        Buffer *b = &op->buffer;
        MPI_Request *request = &batch->reqs[posted];
        code = op->receive ? MPI_Irecv(b->address, b->count, MPI_BYTE, op->peer, op->tag, handle, request)
                           : MPI_Isend(b->address, b->count, MPI_BYTE, op->peer, op->tag, handle, request);
        if (code != MPI_SUCCESS) {
            *request = MPI_REQUEST_NULL;
            break;
        }
    }
    Py_XSETREF(batch->state, Py_NewRef(pending_obj));
    if (code != MPI_SUCCESS) { /* BatchWork._withdraw cancels what was posted and words the error */
        PyObject *exc = mpi_error(code);
        PyObject *count = PyLong_FromSsize_t(posted);
        PyObject *error =
            exc && count && batch_fill(batch, posted) == 0
                ? PyObject_CallMethodObjArgs((PyObject *)batch, s_withdraw, s_batch_what, exc, count, NULL)
                : NULL;
        Py_XDECREF(count);
        Py_DECREF(batch);
        if (error == NULL)
            Py_CLEAR(exc);
        raise_with_cause(error, exc);
        goto out;
    }
    result = (PyObject *)batch;
out:
    Py_DECREF(held);
    Py_DECREF(comm);
    if (ops != small)
        PyMem_Free(ops);
    if (spans != small_spans)
        PyMem_Free(spans);
    return release_retired_after(result);
}

/* --- isend, irecv, send, recv ---------------------------------------------------------------------- */

/* The arguments of isend/irecv/send/recv: (tensor, peer, group, tag, group_peer), or 0 when they are not
 * the plain positional/keyword forms this parses (the reference then parses them itself). */
static int
p2p_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *peer_name, const char *group_name,
         PyObject **out)
{
    static const char *names[5] = {"tensor", NULL, "group", "tag", NULL};
    out[0] = NULL;
    out[1] = out[2] = out[4] = Py_None;
    out[3] = NULL;
    if (nargs > 5)
        return 0;
    for (Py_ssize_t i = 0; i < nargs; i++)
        out[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
        if (name == NULL) {
            PyErr_Clear();
            return 0;
        }
        int slot = -1;
        for (int j = 0; j < 5; j++) {
            const char *expected = j == 1 ? peer_name : j == 4 ? group_name : names[j];
            if (strcmp(name, expected) == 0)
                slot = j;
        }
        if (slot < nargs) /* unknown, or given twice */
            return 0;
        out[slot] = args[nargs + k];
    }
    return out[0] != NULL;
}

/* Where a call goes in the common case (validate.resolve_peer's, in C): 1 with the group, the peer's rank in it (or
 * MPI_ANY_SOURCE where ``any`` allows it) and the tag; 0 for the Python path, which checks and words everything. */
static int
lean_target(PyObject **a, int any, PyObject **pg, int *peer, int *tag)
{
    if (!gate() || (a[1] != Py_None && a[4] != Py_None) || (a[1] == Py_None && a[4] == Py_None && !any))
        return 0;
    *tag = a[3] == NULL ? 0 : small_rank(a[3], tag_ub);
    if (*tag < 0)
        return 0;
    if (a[1] == Py_None && a[4] == Py_None) { /* a receive from any source */
        *pg = a[2] == Py_None ? world : a[2];
        *peer = MPI_ANY_SOURCE;
        return *pg == world || PyObject_TypeCheck(*pg, (PyTypeObject *)group_type);
    }
    if (a[2] == Py_None && a[4] == Py_None) { /* the world: group and global ranks agree */
        *pg = world;
        *peer = small_rank(a[1], world_size - 1);
        return *peer >= 0;
    }
    PyObject *group = a[2] == Py_None ? world : a[2];
    if (!PyObject_TypeCheck(group, (PyTypeObject *)group_type))
        return 0;
    PyObject *global_of = PyObject_GetAttr(group, s_global_of);
    if (global_of == NULL || !PyTuple_Check(global_of)) {
        Py_XDECREF(global_of);
        PyErr_Clear();
        return 0;
    }
    Py_ssize_t size = PyTuple_GET_SIZE(global_of);
    Py_DECREF(global_of); /* the group holds it */
    if (a[4] != Py_None)
        *peer = small_rank(a[4], size - 1);
    else { /* a global rank: its rank in the group */
        PyObject *group_of = PyLong_CheckExact(a[1]) ? PyObject_GetAttr(group, s_group_of) : NULL;
        PyObject *rank = group_of && PyDict_Check(group_of) ? PyDict_GetItemWithError(group_of, a[1]) : NULL;
        *peer = rank != NULL ? small_rank(rank, size - 1) : -1;
        Py_XDECREF(group_of);
        PyErr_Clear();
    }
    *pg = group;
    return *peer >= 0;
}

/* The global rank of group rank ``rank`` of ``group`` (a new reference), or NULL with an error. */
static PyObject *
global_rank(PyObject *group, int rank)
{
    if (group == world)
        return PyLong_FromLong(rank);
    PyObject *global_of = PyObject_GetAttr(group, s_global_of);
    PyObject *global = global_of ? PySequence_GetItem(global_of, rank) : NULL;
    Py_XDECREF(global_of);
    return global;
}

static PyObject *
lean_post(PyObject *reference, PyObject *what, int receive, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[5], *taken = NULL, *pg, *comm = NULL;
    Buffer buffer;
    int peer, tag;
    int which = receive ? C_IRECV : C_ISEND;
    calls_made[which]++;
    if (p2p_args(args, nargs, kwnames, receive ? "src" : "dst", receive ? "group_src" : "group_dst", a) &&
        lean_target(a, receive, &pg, &peer, &tag))
        comm = group_comm(pg);
    if (comm == NULL)
        return HANDED(which, PyObject_Vectorcall(reference, args, nargs, kwnames));
    int r = lean_buffer(a[0], receive, what, &buffer, &taken, STRIDED_IN_C);
    if (r <= 0) {
        Py_DECREF(comm);
        if (r < 0)
            return NULL;
        if (taken != NULL) /* resolved here, with more to do after MPI: the Python Work posts it */
            return release_retired_after(HANDED(which, python_work(pg, receive, peer, tag, taken, what)));
        return HANDED(which, PyObject_Vectorcall(reference, args, nargs, kwnames));
    }
    WorkObject *work = reap() == 0 ? new_work(pg, receive, peer, tag, &buffer) : NULL;
    Py_XDECREF(buffer.keep); /* the Work holds them now, unless it could not be made */
    Py_XDECREF(buffer.after);
    if (work != NULL && post_work(work, comm, &buffer, peer, tag) != MPI_SUCCESS) {
        Py_CLEAR(work); /* not posted: the Python path posts it again and words MPI's error */
        Py_DECREF(comm);
        return release_retired_after(HANDED(which, PyObject_Vectorcall(reference, args, nargs, kwnames)));
    }
    Py_DECREF(comm);
    return release_retired_after((PyObject *)work);
}

/* The caller's rank in ``group``, or -1. */
static int
own_rank(PyObject *group)
{
    if (group == world)
        return world_rank;
    PyObject *group_of = PyObject_GetAttr(group, s_group_of);
    PyObject *me = PyLong_FromLong(world_rank);
    PyObject *rank = group_of && me && PyDict_Check(group_of) ? PyDict_GetItemWithError(group_of, me) : NULL;
    int result = rank != NULL ? small_rank(rank, INT_MAX) : -1;
    Py_XDECREF(group_of);
    Py_XDECREF(me);
    PyErr_Clear();
    return result;
}

static PyObject *
lean_blocking(PyObject *reference, PyObject *what, int receive, PyObject *const *args, Py_ssize_t nargs,
              PyObject *kwnames)
{
    PyObject *a[5], *taken = NULL, *pg, *comm = NULL;
    Buffer buffer;
    int peer, tag, code;
    int which = receive ? C_RECV : C_SEND;
    calls_made[which]++;
    if (p2p_args(args, nargs, kwnames, receive ? "src" : "dst", receive ? "group_src" : "group_dst", a) &&
        lean_target(a, receive, &pg, &peer, &tag) && peer != own_rank(pg)) /* a call to itself: the Python error */
        comm = group_comm(pg);
    if (comm == NULL)
        return HANDED(which, PyObject_Vectorcall(reference, args, nargs, kwnames));
    int r = lean_buffer(a[0], receive, what, &buffer, &taken, STRIDED_IN_C);
    if (r == 0 && taken != NULL) { /* as ops._blocking does with a buffer that has more to do: a Work, waited */
        calls_handed[which]++;
        Py_DECREF(comm);
        PyObject *work = python_work(pg, receive, peer, tag, taken, what);
        PyObject *done = work ? PyObject_CallMethodNoArgs(work, s_wait) : NULL;
        PyObject *source = done == NULL ? NULL
                           : receive    ? PyObject_CallMethodNoArgs(work, s_source_rank)
                                        : Py_NewRef(Py_None);
        Py_XDECREF(done);
        Py_XDECREF(work);
        return release_retired_after(source);
    }
    if (r <= 0 || reap() < 0) {
        Py_DECREF(comm);
        if (r > 0) {
            Py_DECREF(buffer.keep);
            Py_XDECREF(buffer.after);
        }
        return r == 0 ? HANDED(which, PyObject_Vectorcall(reference, args, nargs, kwnames)) : NULL;
    }
    MPI_Status status;
    MPI_Datatype datatype = datatype_of(&buffer);
    MPI_Comm handle = *PyMPIComm_Get(comm);
    blank_status(&status);
    /* MPI_Isend/MPI_Irecv and their completion are what MPI_Send/MPI_Recv are; an op complete at once (a small
     * send, a message already there) is then finished without giving up the GIL */
    MPI_Request request;
    int done = 0;
    code = receive ? MPI_Irecv(buffer.address, buffer.count, datatype, peer, tag, handle, &request)
                   : MPI_Isend(buffer.address, buffer.count, datatype, peer, tag, handle, &request);
    if (code == MPI_SUCCESS)
        code = MPI_Test(&request, &done, &status);
    if (code == MPI_SUCCESS && !done) {
        WaitRecord *record = wait_begin(NULL);
        if (record != NULL)
            *record =
                (WaitRecord){record->ident, record->serial, NULL, pg, receive, peer, tag, buffer.nbytes, monotonic()};
        Py_BEGIN_ALLOW_THREADS
        code = MPI_Wait(&request, &status);
        Py_END_ALLOW_THREADS
        wait_end(record);
    }
    if (buffer.after != NULL && /* packed: a receive's message into the array, if it came whole; the buffer back */
        packed_finish((PackedObject *)buffer.after,
                      code == MPI_SUCCESS && (!receive || received_bytes(&status) == buffer.nbytes)) < 0) {
        Py_DECREF(buffer.after);
        Py_DECREF(buffer.keep);
        Py_DECREF(comm);
        return release_retired_after(NULL);
    }
    Py_XDECREF(buffer.after);
    Py_DECREF(buffer.keep);
    Py_DECREF(comm);
    if (code != MPI_SUCCESS) { /* worded as ops._blocking words it */
        int found = receive && peer == MPI_ANY_SOURCE ? status.MPI_SOURCE : -1;
        PyObject *source = found >= 0 ? global_rank(pg, found) : peer >= 0 ? global_rank(pg, peer) : Py_NewRef(Py_None);
        PyObject *error = source ? PyObject_CallFunction(failure, "OOini", receive ? Py_True : Py_False, source, tag,
                                                         buffer.nbytes, code)
                                 : NULL;
        Py_XDECREF(source);
        PyObject *cause = error ? mpi_error(code) : NULL;
        if (error != NULL && cause == NULL)
            Py_CLEAR(error);
        raise_with_cause(error, cause);
        return release_retired_after(NULL);
    }
    if (!receive)
        return release_retired_after(Py_NewRef(Py_None));
    if (status.MPI_SOURCE == MPI_PROC_NULL)
        return release_retired_after(PyLong_FromLong(-1));
    PyObject *source = global_rank(pg, status.MPI_SOURCE);
    Py_ssize_t got = received_bytes(&status);
    if (source != NULL && got != buffer.nbytes) {
        raise_with_cause(PyObject_CallFunction(size_error, "Oinn", source, status.MPI_TAG, buffer.nbytes, got), NULL);
        Py_CLEAR(source);
    }
    return release_retired_after(source);
}

/* The module's isend, irecv, send and recv: the lean call with the reference it stands in for. */
#define LEAN_CALL(name, lean, reference, what, receive)                                                 \
    static PyObject *name(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) \
    {                                                                                                   \
        return lean(reference, what, receive, args, PyVectorcall_NARGS(nargs), kwnames);                \
    }
LEAN_CALL(lean_isend, lean_post, ref_isend, s_isend_what, 0)
LEAN_CALL(lean_irecv, lean_post, ref_irecv, s_irecv_what, 1)
LEAN_CALL(lean_send, lean_blocking, ref_send, s_send_what, 0)
LEAN_CALL(lean_recv, lean_blocking, ref_recv, s_recv_what, 1)

PyDoc_STRVAR(isend_doc,
             "isend($module, /, tensor, dst=None, group=None, tag=0, group_dst=None)\n--\n\n"
             "Send ``tensor`` to ``dst`` (global rank) or ``group_dst`` (rank in ``group``) without blocking.");
PyDoc_STRVAR(irecv_doc, "irecv($module, /, tensor, src=None, group=None, tag=0, group_src=None)\n--\n\n"
                        "Receive into ``tensor`` from ``src``/``group_src`` (any source if neither) without blocking.");
PyDoc_STRVAR(send_doc, "send($module, /, tensor, dst=None, group=None, tag=0, group_dst=None)\n--\n\n"
                       "Send ``tensor`` and block until its buffer may be reused.");
PyDoc_STRVAR(recv_doc,
             "recv($module, /, tensor, src=None, group=None, tag=0, group_src=None)\n--\n\n"
             "Receive into ``tensor``, blocking; returns the sender's global rank (-1 if not a group member).");

/* --- collectives ---------------------------------------------------------------------------------- */

/* The collectives the engine takes: for contiguous host tensors, MPI-native dtypes and in-place reductions, one
 * nonblocking MPI collective posted here, the very one the Python reference posts (so that members on either engine
 * match), completed here when the call is blocking.  Anything else (a list argument, splits, a staged, packed or
 * widened buffer, AVG, a timeout, a group to reconcile, ...) is handed to the reference before anything is counted
 * or posted.  An ``async_op`` call gets the reference's CollectiveWork, made by ``posted`` around the request. */

enum {
    K_ALL_REDUCE,
    K_BROADCAST,
    K_REDUCE,
    K_ALL_GATHER_INTO_TENSOR,
    K_REDUCE_SCATTER_TENSOR,
    K_ALL_TO_ALL_SINGLE,
    K_BARRIER,
    K_ALL_GATHER,
    K_GATHER,
    K_SCATTER,
    K_KINDS
};
#define K_PARAMS 6
#define SPIN 20e-6 /* seconds a blocking collective is tested with the GIL kept before MPI_Wait without it */

/* Each collective's parameters, in the reference's order: the C call parses exactly these. */
static const char *const coll_params[K_KINDS][K_PARAMS] = {
    [K_ALL_REDUCE] = {"tensor", "op", "group", "async_op"},
    [K_BROADCAST] = {"tensor", "src", "group", "async_op", "group_src"},
    [K_REDUCE] = {"tensor", "dst", "op", "group", "async_op", "group_dst"},
    [K_ALL_GATHER_INTO_TENSOR] = {"output_tensor", "input_tensor", "group", "async_op"},
    [K_REDUCE_SCATTER_TENSOR] = {"output", "input", "op", "group", "async_op"},
    [K_ALL_TO_ALL_SINGLE] = {"output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"},
    [K_BARRIER] = {"group", "async_op", "device_ids", "timeout"},
    [K_ALL_GATHER] = {"tensor_list", "tensor", "group", "async_op"},
    [K_GATHER] = {"tensor", "gather_list", "dst", "group", "async_op", "group_dst"},
    [K_SCATTER] = {"tensor", "scatter_list", "src", "group", "async_op", "group_src"},
};
static const int coll_calls[K_KINDS] = {
    /* each one's entry in the counts */
    [K_ALL_REDUCE] = C_ALL_REDUCE,
    [K_BROADCAST] = C_BROADCAST,
    [K_REDUCE] = C_REDUCE,
    [K_ALL_GATHER_INTO_TENSOR] = C_ALL_GATHER_INTO_TENSOR,
    [K_REDUCE_SCATTER_TENSOR] = C_REDUCE_SCATTER_TENSOR,
    [K_ALL_TO_ALL_SINGLE] = C_ALL_TO_ALL_SINGLE,
    [K_BARRIER] = C_BARRIER,
    [K_ALL_GATHER] = C_ALL_GATHER,
    [K_GATHER] = C_GATHER,
    [K_SCATTER] = C_SCATTER,
};

static PyObject *ref_coll[K_KINDS];  /* the Python reference of each */
static PyObject *coll_what[K_KINDS]; /* each one's name, interned */
static PyObject *coll_posted, *coll_recipe, *stranded, *sum_op, *one_obj, *mark_refused;
static PyObject *s_steps, *s_calls, *s_oversubscribed, *s_dtype, *s_shape;

/* A call's arguments by parameter (NULL: not given), or 0 where they are not plain positional/keyword forms of
 * the reference's parameters (which then parses them itself). */
static int
coll_args(int kind, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out)
{
    const char *const *params = coll_params[kind];
    int n = 0;
    while (n < K_PARAMS && params[n] != NULL)
        n++;
    for (int i = 0; i < K_PARAMS; i++)
        out[i] = NULL;
    if (nargs > n)
        return 0;
    for (Py_ssize_t i = 0; i < nargs; i++)
        out[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int slot = -1;
        for (int j = 0; j < n && slot < 0; j++)
            if (PyUnicode_CompareWithASCIIString(name, params[j]) == 0)
                slot = j;
        if (slot < 0 || out[slot] != NULL) /* unknown, or given twice */
            return 0;
        out[slot] = args[nargs + k];
    }
    return 1;
}

static int
is_none(PyObject *v)
{
    return v == NULL || v == Py_None;
}

/* Where a collective runs in the common case: 1 with the group, its communicator (owned), the caller's rank and the
 * group's size; 0 for the Python path. */
typedef struct {
    PyObject *pg, *comm;
    int rank, size;
} Where;

static int
coll_where(PyObject *group, Where *w)
{
    if (!gate() || PyList_GET_SIZE(stranded) > 0)
        return 0;
    PyObject *pg = is_none(group) ? world : group;
    if (pg != world && !PyObject_TypeCheck(pg, (PyTypeObject *)group_type))
        return 0;
    PyObject *steps = PyObject_GetAttr(pg, s_steps); /* a refused call to reconcile first, or out of step */
    if (steps == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(steps);
    if (steps != Py_None)
        return 0;
    w->size = world_size;
    if (pg != world) {
        PyObject *global_of = PyObject_GetAttr(pg, s_global_of);
        if (global_of == NULL || !PyTuple_Check(global_of)) {
            Py_XDECREF(global_of);
            PyErr_Clear();
            return 0;
        }
        w->size = (int)PyTuple_GET_SIZE(global_of);
        Py_DECREF(global_of); /* the group holds it */
    }
    w->rank = own_rank(pg);
    if (w->rank < 0) /* not a member: the reference warns */
        return 0;
    w->comm = group_comm(pg);
    w->pg = pg;
    return w->comm != NULL;
}

/* The root's group rank from exactly one of a global and a group rank (validate.resolve_peer's common case), or -1. */
static int
coll_root(Where *w, PyObject *global, PyObject *local)
{
    if (is_none(global) == is_none(local))
        return -1;
    if (!is_none(local))
        return small_rank(local, w->size - 1);
    if (w->pg == world)
        return small_rank(global, world_size - 1);
    if (!PyLong_CheckExact(global))
        return -1;
    PyObject *group_of = PyObject_GetAttr(w->pg, s_group_of);
    PyObject *rank = group_of && PyDict_Check(group_of) ? PyDict_GetItemWithError(group_of, global) : NULL;
    int result = rank != NULL ? small_rank(rank, w->size - 1) : -1;
    Py_XDECREF(group_of);
    PyErr_Clear();
    return result;
}

/* One tensor of a collective, as plain bytes (``writes``: the collective writes it): 1, 0 for the Python path,
 * -1 on an error to raise. */
static int
coll_buffer(PyObject *tensor, int writes, PyObject *what, Buffer *out)
{
    PyObject *taken = NULL;
    if (tensor == NULL)
        return 0;
    int r = lean_buffer(tensor, writes, what, out, &taken, STRIDED_HAND);
    if (r == 0 && taken != NULL)
        return give_back(taken) < 0 ? -1 : 0;
    if (r > 0 && out->datatype != NULL) { /* resolved to a derived datatype: the reference prepares it */
        Py_CLEAR(out->keep);
        return 0;
    }
    return r;
}

/* How MPI reduces ``tensor``'s dtype with ``op`` in place, as it is: 1 with the datatype, op and item size; 0 where the
 * reduction needs more (widening, AVG's division) or is refused (the reference words why); -1 on an error.  The
 * reference's ``recipe`` decides; the answers it marks as kept are remembered here by the identity of the dtype and op
 * objects (a dtype's hash can cost more than the collective's whole call), a few pairs, the oldest replaced. */
#define RECIPES 16
typedef struct {
    PyObject *dtype, *op; /* owned, NULL: a free entry */
    MPI_Datatype datatype;
    MPI_Op mpi_op;
    Py_ssize_t itemsize;
} Recipe;
static Recipe recipes[RECIPES];
static int next_recipe = 0;

static int
coll_reduction(PyObject *tensor, PyObject *op, MPI_Datatype *datatype, MPI_Op *mpi_op, Py_ssize_t *itemsize)
{
    PyObject *dtype = PyObject_GetAttr(tensor, s_dtype);
    if (dtype == NULL)
        return clear_error();
    for (int i = 0; i < RECIPES; i++)
        if (recipes[i].dtype == dtype && recipes[i].op == op) {
            Py_DECREF(dtype);
            *datatype = recipes[i].datatype, *mpi_op = recipes[i].mpi_op, *itemsize = recipes[i].itemsize;
            return 1;
        }
    PyObject *found = PyObject_CallFunctionObjArgs(coll_recipe, tensor, op, NULL); /* (datatype, op, size, keep) */
    if (found == NULL) {
        Py_DECREF(dtype);
        return -1;
    }
    int ok = PyTuple_CheckExact(found) && PyTuple_GET_SIZE(found) == 4 &&
             PyObject_TypeCheck(PyTuple_GET_ITEM(found, 0), &PyMPIDatatype_Type) &&
             PyObject_TypeCheck(PyTuple_GET_ITEM(found, 1), &PyMPIOp_Type) && PyLong_Check(PyTuple_GET_ITEM(found, 2));
    if (ok) {
        *datatype = *PyMPIDatatype_Get(PyTuple_GET_ITEM(found, 0));
        *mpi_op = *PyMPIOp_Get(PyTuple_GET_ITEM(found, 1));
        *itemsize = PyLong_AsSsize_t(PyTuple_GET_ITEM(found, 2));
        ok = *itemsize > 0; /* predefined datatypes and ops: their handles stay valid */
    }
    if (ok && PyTuple_GET_ITEM(found, 3) == Py_True) {
        Recipe *entry = &recipes[next_recipe];
        next_recipe = (next_recipe + 1) % RECIPES;
        Py_XSETREF(entry->dtype, Py_NewRef(dtype));
        Py_XSETREF(entry->op, Py_NewRef(op));
        entry->datatype = *datatype, entry->mpi_op = *mpi_op, entry->itemsize = *itemsize;
    }
    Py_DECREF(dtype);
    Py_DECREF(found);
    PyErr_Clear();
    return ok;
}

/* A tensor's dim 0 and the elements of one row along it (all_to_all_single's split): 1, or 0 for the Python path. */
static int
rows_of(PyObject *tensor, Py_ssize_t *rows, Py_ssize_t *row)
{
    PyObject *shape = PyObject_GetAttr(tensor, s_shape);
    if (shape == NULL)
        return clear_error() < 0 ? -1 : 0;
    int ok = PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0;
    Py_ssize_t elements = 1;
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(shape); i++) {
        PyObject *extent = PyTuple_GET_ITEM(shape, i);
        Py_ssize_t n = PyLong_Check(extent) ? PyLong_AsSsize_t(extent) : -1;
        if (n < 0) {
            PyErr_Clear();
            ok = 0;
        } else if (i == 0)
            *rows = n;
        else
            elements *= n;
    }
    Py_DECREF(shape);
    *row = elements;
    return ok;
}

static int
overlaps(Buffer *a, Buffer *b)
{
    char *x = a->address, *y = b->address;
    return a->nbytes > 0 && b->nbytes > 0 && x < y + b->nbytes && y < x + a->nbytes;
}

typedef struct {
    char *address;
    Py_ssize_t index;
} Placed;

static int
by_address(const void *x, const void *y)
{
    char *a = ((const Placed *)x)->address, *b = ((const Placed *)y)->address;
    return a < b ? -1 : a > b;
}

/* A list argument of one tensor per member (``n``), each of ``like``'s type and dtype and of ``one->nbytes`` bytes, as
 * one MPI buffer of bytes (what the reference's ``arguments.Blocks`` is for contiguous host tensors): the lowest
 * address (``*base``), each tensor's byte count and byte displacement from it (``sizes``, ``displs``), and the tensors
 * in a new list (``*items``).  1; 0 for the Python path (a list or tuple of another length or anything else, an element
 * of another type, dtype or size, or not plain host memory, two of them or one and ``one`` that overlap, a span past
 * INT_MAX); -1 on an error to raise. */
static int
coll_list(PyObject *list, PyObject *like, Buffer *one, int writes, PyObject *what, int n, char **base, int *sizes,
          int *displs, PyObject **items)
{
    if (list == NULL || !(PyList_CheckExact(list) || PyTuple_CheckExact(list)) || Py_SIZE(list) != n ||
        one->nbytes <= 0 || one->nbytes > INT_MAX)
        return 0;
    PyObject *dtype = PyObject_GetAttr(like, s_dtype);
    if (dtype == NULL)
        return clear_error() < 0 ? -1 : 0;
    Placed *placed = PyMem_New(Placed, (size_t)n + 1);
    PyObject *made = placed != NULL ? PyList_New(n) : NULL;
    int r = made != NULL ? 1 : -1;
    if (placed == NULL)
        PyErr_NoMemory();
    for (int i = 0; r > 0 && i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(list, i);
        Buffer b = {0};
        if (Py_TYPE(item) != Py_TYPE(like) || (r = coll_buffer(item, writes, what, &b)) <= 0) {
            r = r < 0 ? -1 : 0;
            break;
        }
        Py_CLEAR(b.keep); /* the tensor, held by ``made``, keeps its memory */
        PyObject *d = b.nbytes == one->nbytes ? PyObject_GetAttr(item, s_dtype) : NULL;
        int same = d == NULL                      ? (b.nbytes == one->nbytes ? -1 : 0)
                   : d == dtype                   ? 1
                   : Py_TYPE(d) == Py_TYPE(dtype) ? PyObject_RichCompareBool(d, dtype, Py_EQ)
                                                  : 0;
        Py_XDECREF(d);
        if (same <= 0) {
            r = same < 0 ? (clear_error() < 0 ? -1 : 0) : 0;
            break;
        }
        placed[i] = (Placed){b.address, i};
        PyList_SET_ITEM(made, i, Py_NewRef(item));
    }
    if (r > 0) {
        char *low = placed[0].address;
        for (int i = 1; i < n; i++)
            low = placed[i].address < low ? placed[i].address : low;
        placed[n] = (Placed){one->address, n};
        qsort(placed, (size_t)n + 1, sizeof(Placed), by_address);
        for (int i = 0; r > 0 && i < n; i++) /* all of one->nbytes: apart when each starts past the one before */
            if (placed[i + 1].address - placed[i].address < one->nbytes)
                r = 0;
        for (int i = 0; r > 0 && i <= n; i++) {
            Py_ssize_t k = placed[i].index;
            if (k == n)
                continue;
            if (placed[i].address - low > INT_MAX - one->nbytes)
                r = 0;
            else
                sizes[k] = (int)one->nbytes, displs[k] = (int)(placed[i].address - low);
        }
        *base = low;
    }
    Py_DECREF(dtype);
    PyMem_Free(placed);
    if (r > 0)
        *items = made;
    else
        Py_XDECREF(made);
    return r;
}

/* The handle of a posted collective, made by the reference's ``posted`` (and failed with ``code`` unless 0). */
static PyObject *
coll_handle(int kind, Where *w, int root, PyObject *op, PyObject *described, PyObject *outputs, PyObject *inputs,
            MPI_Request *request, int code)
{
    PyObject *req = PyMPIRequest_New(*request);
    PyObject *at = root >= 0 ? PyLong_FromLong(root) : Py_NewRef(Py_None);
    PyObject *handle = req && at ? PyObject_CallFunction(coll_posted, "OOOOOOOOi", coll_what[kind], w->pg, at,
                                                         op ? op : Py_None, described ? described : Py_None, outputs,
                                                         inputs ? inputs : Py_None, req, code)
                                 : NULL;
    if (handle != NULL)
        *request = MPI_REQUEST_NULL; /* the handle's now */
    Py_XDECREF(req);
    Py_XDECREF(at);
    return handle;
}

/* Complete a posted collective: MPI_Test first, so that one already complete keeps the GIL, then MPI_Wait (or, on an
 * oversubscribed node, MPI_Test with a yield between) without it.  None, or the handle's error raised. */
static PyObject *
coll_complete(int kind, Where *w, int root, PyObject *op, PyObject *described, PyObject *outputs, PyObject *inputs,
              MPI_Request *request, Py_ssize_t nbytes)
{
    int done = 0;
    MPI_Status status;
    int yielding = 0, code = MPI_Test(request, &done, &status);
    if (code == MPI_SUCCESS && !done) {
        PyObject *v = PyObject_GetAttr(state, s_oversubscribed);
        yielding = v == NULL || v == Py_True;
        Py_XDECREF(v);
        PyErr_Clear();
        /* a collective of the members in step completes within microseconds: tested a while with the GIL kept, since
         * giving it up and back costs about as much (not where the ranks share cores: the others must run) */
        for (double until = yielding ? 0.0 : monotonic() + SPIN;
             code == MPI_SUCCESS && !done && !yielding && monotonic() < until;)
            code = MPI_Test(request, &done, &status);
    }
    if (code == MPI_SUCCESS && !done) {
        WaitRecord *record = wait_begin(NULL);
        if (record != NULL)
            *record = (WaitRecord){record->ident, record->serial, NULL,           w->pg, 0, root, -1,
                                   nbytes,        monotonic(),    coll_what[kind]};
        Py_BEGIN_ALLOW_THREADS
        if (yielding)
            while ((code = MPI_Test(request, &done, &status)) == MPI_SUCCESS && !done)
                sched_yield();
        else
            code = MPI_Wait(request, &status);
        Py_END_ALLOW_THREADS
        wait_end(record);
    }
    if (code == MPI_SUCCESS)
        Py_RETURN_NONE;
    PyObject *handle = coll_handle(kind, w, root, op, described, outputs, inputs, request, code);
    if (handle == NULL)
        return NULL;
    PyObject *r = PyObject_CallMethodNoArgs(handle, s_wait); /* raises the failure, worded by the reference */
    Py_DECREF(handle);
    Py_XDECREF(r);
    return r == NULL ? NULL : Py_NewRef(Py_None);
}

/* The call counted on its group, as ``checks.collective_group`` counts it (``calls += 1``): 0, or -1 with an error. */
static int
count_call(PyObject *pg)
{
    PyObject *calls = PyObject_GetAttr(pg, s_calls);
    PyObject *next = calls ? PyNumber_Add(calls, one_obj) : NULL;
    int r = next != NULL ? PyObject_SetAttr(pg, s_calls, next) : -1;
    Py_XDECREF(calls);
    Py_XDECREF(next);
    return r;
}

/* A posted request that no handle took (an error or an interrupt right after the post): kept in ``stranded`` with
 * what its buffers need, as CollectiveWork keeps a failed one, never waited here with the GIL held.  The error being
 * raised is kept; only if even that fails is the request completed here, without the GIL. */
static void
strand(MPI_Request *request, PyObject *outputs, PyObject *inputs, PyObject *one, PyObject *two, PyObject *counts)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *req = PyMPIRequest_New(*request);
    PyObject *entry = req ? Py_BuildValue("([O][OOOOO])", req, outputs ? outputs : Py_None, inputs ? inputs : Py_None,
                                          one ? one : Py_None, two ? two : Py_None, counts ? counts : Py_None)
                          : NULL;
    if (entry != NULL && PyList_Append(stranded, entry) == 0)
        *request = MPI_REQUEST_NULL;
    Py_XDECREF(entry);
    Py_XDECREF(req);
    PyErr_Clear();
    if (*request != MPI_REQUEST_NULL) {
        Py_BEGIN_ALLOW_THREADS
        MPI_Wait(request, MPI_STATUS_IGNORE);
        Py_END_ALLOW_THREADS
    }
    PyErr_Restore(type, value, tb);
}

/* A call that raised after its group was taken (an interrupt in a resolver, say): counted on the group and noted as
 * refused, as ``checks.collective_group`` and ``checks.refused`` do, so that the members stay in step. */
static void
refused_here(PyObject *pg, int kind)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (count_call(pg) == 0)
        Py_XDECREF(PyObject_CallFunctionObjArgs(mark_refused, pg, coll_what[kind], NULL));
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

static PyObject *
lean_collective(int kind, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *a[K_PARAMS], *what = coll_what[kind];
    int which = coll_calls[kind];
    Where w = {NULL, NULL, 0, 0};
    Buffer one = {0}, two = {0};
    MPI_Datatype datatype = MPI_BYTE;
    MPI_Op mpi_op = MPI_OP_NULL;
    Py_ssize_t itemsize = 1;
    int root = -1, r = 0, code = MPI_SUCCESS;
    Py_ssize_t shown = 0; /* the bytes a description names */
    MPI_Request request = MPI_REQUEST_NULL;
    PyObject *op = NULL, *async_op = NULL, *group = NULL, *outputs = NULL, *inputs = NULL, *described = NULL;
    PyObject *counts = NULL; /* all_to_all_single's counts and displacements */
    calls_made[which]++;
    if (ref_coll[kind] == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the compiled engine is not set up");
        return NULL;
    }
    if (!coll_args(kind, args, nargs, kwnames, a))
        goto hand;
    switch (kind) { /* the parameters' places (coll_params) */
    case K_ALL_REDUCE:
        op = a[1], group = a[2], async_op = a[3];
        break;
    case K_BROADCAST:
        group = a[2], async_op = a[3];
        break;
    case K_REDUCE:
        op = a[2], group = a[3], async_op = a[4];
        break;
    case K_ALL_GATHER_INTO_TENSOR:
        group = a[2], async_op = a[3];
        break;
    case K_REDUCE_SCATTER_TENSOR:
        op = a[2], group = a[3], async_op = a[4];
        break;
    case K_ALL_TO_ALL_SINGLE:
        group = a[4], async_op = a[5];
        break;
    case K_ALL_GATHER:
        group = a[2], async_op = a[3];
        break;
    case K_GATHER:
    case K_SCATTER:
        group = a[3], async_op = a[4];
        break;
    default:
        group = a[0], async_op = a[1];
    }
    if (!(async_op == NULL || async_op == Py_False || async_op == Py_True) || !coll_where(group, &w))
        goto hand;
    if (op == NULL)
        op = sum_op;
    if (reap() < 0) { /* the dropped handles MPI is done with, as CollectiveWork does first */
        Py_DECREF(w.comm);
        return NULL;
    }
    MPI_Comm comm = *PyMPIComm_Get(w.comm);
    switch (kind) {
    case K_ALL_REDUCE:
        if ((r = coll_buffer(a[0], 1, what, &one)) <= 0 ||
            (r = coll_reduction(a[0], op, &datatype, &mpi_op, &itemsize)) <= 0)
            goto out;
        if (one.nbytes % itemsize != 0 || one.nbytes / itemsize > INT_MAX)
            goto out;
        code =
            MPI_Iallreduce(MPI_IN_PLACE, one.address, (int)(one.nbytes / itemsize), datatype, mpi_op, comm, &request);
        break;
    case K_REDUCE:
    case K_BROADCAST:
        if ((root = kind == K_REDUCE ? coll_root(&w, a[1], a[5]) : coll_root(&w, a[1], a[4])) < 0)
            goto out;
        if (kind == K_BROADCAST) {
            if ((r = coll_buffer(a[0], root != w.rank, what, &one)) <= 0)
                goto out;
            code = MPI_Ibcast(one.address, (int)one.nbytes, MPI_BYTE, root, comm, &request);
            op = NULL;
            break;
        }
        if ((r = coll_buffer(a[0], root == w.rank, what, &one)) <= 0 ||
            (r = coll_reduction(a[0], op, &datatype, &mpi_op, &itemsize)) <= 0)
            goto out;
        if (one.nbytes % itemsize != 0 || one.nbytes / itemsize > INT_MAX)
            goto out;
        code = root == w.rank ? MPI_Ireduce(MPI_IN_PLACE, one.address, (int)(one.nbytes / itemsize), datatype, mpi_op,
                                            root, comm, &request)
                              : MPI_Ireduce(one.address, NULL, (int)(one.nbytes / itemsize), datatype, mpi_op, root,
                                            comm, &request);
        break;
    case K_ALL_GATHER_INTO_TENSOR:
    case K_REDUCE_SCATTER_TENSOR:
    case K_ALL_TO_ALL_SINGLE: {
        /* one: the output, two: the input; of one type and one dtype, apart */
        if (a[0] == NULL || a[1] == NULL || Py_TYPE(a[0]) != Py_TYPE(a[1]))
            goto out;
        if ((r = coll_buffer(a[0], 1, what, &one)) <= 0 || (r = coll_buffer(a[1], 0, what, &two)) <= 0)
            goto out;
        if (overlaps(&one, &two))
            goto out;
        PyObject *d1 = PyObject_GetAttr(a[0], s_dtype), *d2 = d1 ? PyObject_GetAttr(a[1], s_dtype) : NULL;
        int same = d2 == NULL                   ? -1
                   : d1 == d2                   ? 1
                   : Py_TYPE(d1) == Py_TYPE(d2) ? PyObject_RichCompareBool(d1, d2, Py_EQ)
                                                : 0;
        Py_XDECREF(d1);
        Py_XDECREF(d2);
        if (same <= 0) {
            r = same < 0 ? clear_error() : 0;
            goto out;
        }
        op = kind == K_REDUCE_SCATTER_TENSOR ? op : NULL;
        if (kind == K_ALL_GATHER_INTO_TENSOR) {
            if (one.nbytes != two.nbytes * w.size)
                goto out;
            code = MPI_Iallgather(two.address, (int)two.nbytes, MPI_BYTE, one.address, (int)two.nbytes, MPI_BYTE, comm,
                                  &request);
            described = a[1], shown = two.nbytes;
        } else if (kind == K_REDUCE_SCATTER_TENSOR) {
            if (two.nbytes != one.nbytes * w.size ||
                (r = coll_reduction(a[0], op, &datatype, &mpi_op, &itemsize)) <= 0 || one.nbytes % itemsize != 0)
                goto out;
            code = MPI_Ireduce_scatter_block(two.address, one.address, (int)(one.nbytes / itemsize), datatype, mpi_op,
                                             comm, &request);
            described = a[0], shown = one.nbytes;
        } else {
            Py_ssize_t rows_out, rows_in, row_out, row_in;
            PyObject *s1 = a[2], *s2 = a[3];
            if (!(is_none(s1) || ((PyList_CheckExact(s1) || PyTuple_CheckExact(s1)) && Py_SIZE(s1) == 0)) ||
                !(is_none(s2) || ((PyList_CheckExact(s2) || PyTuple_CheckExact(s2)) && Py_SIZE(s2) == 0)))
                goto out;
            if ((r = rows_of(a[0], &rows_out, &row_out)) <= 0 || (r = rows_of(a[1], &rows_in, &row_in)) <= 0)
                goto out;
            if (row_out != row_in || rows_out % w.size != 0 || rows_in % w.size != 0 || one.nbytes > INT_MAX ||
                two.nbytes > INT_MAX)
                goto out;
            /* the counts and displacements stay MPI's until the collective completes: kept with its inputs */
            counts = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int) * 4 * w.size);
            if (counts == NULL) {
                r = -1;
                goto out;
            }
            int *send_counts = (int *)PyBytes_AS_STRING(counts), *send_displs = send_counts + w.size;
            int *receive_counts = send_displs + w.size, *receive_displs = receive_counts + w.size;
            int sends = (int)(two.nbytes / w.size), receives = (int)(one.nbytes / w.size);
            for (int i = 0; i < w.size; i++) {
                send_counts[i] = sends, send_displs[i] = i * sends;
                receive_counts[i] = receives, receive_displs[i] = i * receives;
            }
            code = MPI_Ialltoallv(two.address, send_counts, send_displs, MPI_BYTE, one.address, receive_counts,
                                  receive_displs, MPI_BYTE, comm, &request);
            described = a[1], shown = two.nbytes;
        }
        break;
    }
    case K_ALL_GATHER:
    case K_GATHER:
    case K_SCATTER: {
        /* one: this rank's tensor (scatter's output, the others' input); the list, held by the root (every rank for
         * all_gather), one tensor per member as one MPI buffer with byte displacements, as the reference posts it */
        PyObject *list = kind == K_ALL_GATHER ? a[0] : a[1], *tensor = kind == K_ALL_GATHER ? a[1] : a[0];
        PyObject *items = NULL;
        char *base = NULL;
        int *sizes = NULL, *displs = NULL;
        if (kind != K_ALL_GATHER && (root = coll_root(&w, a[2], a[5])) < 0)
            goto out;
        if ((r = coll_buffer(tensor, kind == K_SCATTER, what, &one)) <= 0)
            goto out;
        if (kind == K_ALL_GATHER || root == w.rank) {
            counts = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int) * 2 * w.size);
            if (counts == NULL) {
                r = -1;
                goto out;
            }
            sizes = (int *)PyBytes_AS_STRING(counts), displs = sizes + w.size;
            if ((r = coll_list(list, tensor, &one, kind != K_SCATTER, what, w.size, &base, sizes, displs, &items)) <= 0)
                goto out;
        } else if (!(is_none(list) || ((PyList_CheckExact(list) || PyTuple_CheckExact(list)) && Py_SIZE(list) == 0)))
            goto out; /* a list on a rank other than the root: the reference refuses it, in torch's words */
        else if (one.nbytes <= 0 || one.nbytes > INT_MAX)
            goto out;
        /* what the handle keeps until completion: outputs as ``result()`` gives them, inputs with the counts */
        PyObject *mine = PyList_New(1);
        if (mine != NULL)
            PyList_SET_ITEM(mine, 0, Py_NewRef(tensor));
        PyObject *listed = items != NULL ? items : PyList_New(0);
        if (kind == K_SCATTER)
            outputs = mine, inputs = listed;
        else
            outputs = listed, inputs = mine;
        if (outputs == NULL || inputs == NULL || (counts != NULL && PyList_Append(inputs, counts) < 0)) {
            r = -1;
            goto out;
        }
        int n = (int)one.nbytes;
        if (kind == K_ALL_GATHER)
            code = MPI_Iallgatherv(one.address, n, MPI_BYTE, base, sizes, displs, MPI_BYTE, comm, &request);
        else if (kind == K_GATHER)
            code = MPI_Igatherv(one.address, n, MPI_BYTE, base, sizes, displs, MPI_BYTE, root, comm, &request);
        else
            code = MPI_Iscatterv(base, sizes, displs, MPI_BYTE, one.address, n, MPI_BYTE, root, comm, &request);
        described = tensor, shown = one.nbytes, op = NULL;
        break;
    }
    default: /* K_BARRIER */
        if (!is_none(a[3]))
            goto out;
        op = NULL;
        code = MPI_Ibarrier(comm, &request);
    }
    if (code != MPI_SUCCESS) /* not posted: the reference posts it again, and words MPI's error */
        goto out;
    int counted = count_call(w.pg) == 0; /* posted: counted on the group */
    PyObject *result = NULL;
    int listed = kind >= K_ALL_GATHER; /* outputs and inputs made before posting */
    int paired = listed || (kind >= K_ALL_GATHER_INTO_TENSOR && kind <= K_ALL_TO_ALL_SINGLE); /* has inputs */
    if (!listed && counted) {
        outputs = PyList_New(kind != K_BARRIER);
        inputs = outputs && paired ? PyList_New(counts != NULL ? 2 : 1) : NULL;
        if (outputs != NULL && kind != K_BARRIER)
            PyList_SET_ITEM(outputs, 0, Py_NewRef(a[0]));
        if (inputs != NULL)
            PyList_SET_ITEM(inputs, 0, Py_NewRef(a[1]));
        if (counts != NULL && inputs != NULL)
            PyList_SET_ITEM(inputs, 1, Py_NewRef(counts));
    }
    if (counted && outputs != NULL && (inputs != NULL || !paired)) {
        if (described == NULL && kind != K_BARRIER)
            described = a[0], shown = one.nbytes;
        result = async_op == Py_True ? coll_handle(kind, &w, root, op, described, outputs, inputs, &request, 0)
                                     : coll_complete(kind, &w, root, op, described, outputs, inputs, &request, shown);
    }
    if (result == NULL && request != MPI_REQUEST_NULL) /* posted, and no handle took it: kept until it completes */
        strand(&request, outputs, inputs, one.keep, two.keep, counts);
    Py_XDECREF(outputs);
    Py_XDECREF(inputs);
    Py_XDECREF(one.keep);
    Py_XDECREF(two.keep);
    Py_XDECREF(counts);
    Py_DECREF(w.comm);
    return result;
out:
    Py_XDECREF(outputs);
    Py_XDECREF(inputs);
    Py_XDECREF(one.keep);
    Py_XDECREF(two.keep);
    Py_XDECREF(counts);
    if (r < 0) /* refused here, after the group was taken: counted and noted, as the reference does (checks.refused) */
        refused_here(w.pg, kind);
    Py_DECREF(w.comm);
    if (r < 0)
        return NULL;
hand:
    return HANDED(which, PyObject_Vectorcall(ref_coll[kind], args, nargsf, kwnames));
}

/* The module's collectives: one object each, called as a function (vectorcall, as fast as a builtin function),
 * that is its Python reference's stand-in: ``__wrapped__`` is the reference, so that inspect.signature and help()
 * show the reference's signature (whose ``op=ReduceOp.SUM`` a builtin's text signature cannot hold) and docstring. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int kind;
} CollectiveObject;

static PyObject *
collective_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return lean_collective(((CollectiveObject *)self)->kind, args, (Py_ssize_t)nargsf, kwnames);
}

/* The reference's attribute ``name``, or ``fallback`` before setup_collectives has given the reference. */
static PyObject *
reference_attribute(PyObject *self, const char *name, PyObject *fallback)
{
    PyObject *reference = ref_coll[((CollectiveObject *)self)->kind];
    return reference != NULL ? PyObject_GetAttrString(reference, name) : Py_NewRef(fallback);
}

static PyObject *
collective_name(PyObject *self, void *qualified)
{
    return reference_attribute(self, qualified ? "__qualname__" : "__name__",
                               coll_what[((CollectiveObject *)self)->kind]);
}

static PyObject *
collective_doc(PyObject *self, void *unused)
{
    return reference_attribute(self, "__doc__", Py_None);
}

static PyObject *
collective_module(PyObject *self, void *unused)
{
    return reference_attribute(self, "__module__", Py_None);
}

static PyObject *
collective_wrapped(PyObject *self, void *unused)
{
    PyObject *reference = ref_coll[((CollectiveObject *)self)->kind];
    if (reference == NULL) {
        PyErr_SetString(PyExc_AttributeError, "__wrapped__: the compiled engine is not set up");
        return NULL;
    }
    return Py_NewRef(reference);
}

static PyObject *
collective_repr(PyObject *self)
{
    return PyUnicode_FromFormat("<compiled collective %U>", coll_what[((CollectiveObject *)self)->kind]);
}

static PyGetSetDef collective_getset[] = {
    {"__name__", collective_name, NULL, NULL, NULL},       {"__qualname__", collective_name, NULL, NULL, (void *)1},
    {"__doc__", collective_doc, NULL, NULL, NULL},         {"__module__", collective_module, NULL, NULL, NULL},
    {"__wrapped__", collective_wrapped, NULL, NULL, NULL}, {NULL},
};

static PyTypeObject Collective_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorplay_p2p._src.engine._accel.Collective",
    .tp_doc = PyDoc_STR("A collective of the compiled engine: its Python reference's stand-in (``__wrapped__``)."),
    .tp_basicsize = sizeof(CollectiveObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(CollectiveObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_repr = collective_repr,
    .tp_getset = collective_getset,
};

static PyObject *
new_collective(int kind)
{
    CollectiveObject *self = PyObject_New(CollectiveObject, &Collective_Type);
    if (self != NULL) {
        self->vectorcall = collective_call;
        self->kind = kind;
    }
    return (PyObject *)self;
}

/* --- halo passes: a differentiable halo exchange's pass on host memory ----------------------------------- */

/* One pass (forward or backward) of one slot of a plan of ``autograd._halo``, built once over the plan's buffer and
 * the persistent requests of its ``P2PPlan``: gather the cells it sends into the buffer by their flat indices (the
 * backward then zeroes them: its ghosts), ``MPI_Startall``, ``MPI_Waitall`` (tested first: a step already complete
 * never gives up the GIL), check each receive's size, and scatter what came back (the forward copies it into the
 * ghosts, the backward adds it into the cells that were sent).  The same operations, in the same order, as the
 * Python pass (``index_select``, ``index_fill_``, the plan's start and wait, ``index_copy_`` / ``index_add_``).
 *
 * A call returns None when done; NotImplemented, before anything is touched, where the Python pass must run it
 * (``gate``: checked mode, the watchdog, a thread that may not call MPI, a torch profiler; or requests freed);
 * else what went wrong, for the Python side to word: an MPI error code, or ``(receive, bytes)`` for a receive of the
 * wrong size (bytes -1: longer than expected).  Either way the step is over, and the tensor in neither state: a
 * whole forward pass may have copied the cells it sends itself, and the gather of a backward pass zeroed the ghosts it
 * sends (as a failed Python pass leaves them).  Addresses are the Python side's: it
 * makes them from tensors this object keeps alive (``keep``) and from a contiguous host tensor of the plan's shape
 * and dtype. */

enum { ADD_NONE, ADD_FLOAT, ADD_DOUBLE }; /* what a backward pass's scatter adds, per component */

/* An index map (the flat indices of a plan's cells, in the buffer's order) as runs of consecutive cells: ``count``
 * pairs (first index, length); a face's rows are a few long runs, its columns many short ones. */
typedef struct {
    Py_ssize_t *runs;
    Py_ssize_t count;
} Runs;

/* The cells a whole pass copies within the tensor (its own neighbour's, where a grid dimension has one process):
 * pairs (slab cell, ghost cell) in the index maps' order, as groups of ``count`` runs of ``length`` cells whose
 * starts step by ``slab_step`` and ``ghost_step`` (a face's column is one group of runs of one cell). */
typedef struct {
    Py_ssize_t slab, ghost, length, count, slab_step, ghost_step;
} CopyGroup;

typedef struct {
    CopyGroup *groups;
    Py_ssize_t count;
} Copies;

typedef struct {
    PyObject_HEAD
    PyObject *requests; /* owned: a tuple of mpi4py Prequest objects, the pass's messages */
    PyObject *keep;     /* owned: what keeps the buffers and index maps alive */
    PyObject *report;   /* owned: what signals' report reads (``pending_lines``) while this waits */
    MPI_Request *reqs;  /* the handles, copied from ``requests`` at each start */
    MPI_Status *statuses;
    Py_ssize_t n, nrecv;
    Py_ssize_t *received;  /* for each receive: its index in ``requests`` and the bytes it expects, in pairs */
    Runs gather, scatter;  /* the cells gathered (in the buffer's order), and those scattered into */
    char *gathered;        /* the buffer the gather fills */
    const char *scattered; /* the buffer the scatter reads */
    /* A whole pass (``run``) gathers and scatters only the cells that travel, and copies (or, backward, adds) the
     * cells it sends to itself directly, once, where ``start`` and ``finish`` take them through the buffer (whose
     * finish may write another tensor than its start read). */
    Runs gather_sent, scatter_received;
    Py_ssize_t gathered_at, scattered_at; /* bytes into the buffers where the whole pass's gather and scatter begin */
    Copies copies;
    int itemsize, adjoint, add;
} HaloPassObject;

/* Copy ``n`` elements of ``size`` bytes: fixed-size copies for the common sizes, which the compiler inlines. */
static inline void
copy_items(char *to, const char *from, Py_ssize_t n, Py_ssize_t size)
{
    if (n == 1 && size == 8)
        memcpy(to, from, 8);
    else if (n == 1 && size == 4)
        memcpy(to, from, 4);
    else if (n == 1 && size == 16)
        memcpy(to, from, 16);
    else
        memcpy(to, from, (size_t)(n * size));
}

static void
halo_gather(HaloPassObject *self, char *flat, const Runs *gather, char *to)
{
    const Py_ssize_t size = self->itemsize;
    for (Py_ssize_t r = 0; r < gather->count; r++) {
        Py_ssize_t start = gather->runs[2 * r], n = gather->runs[2 * r + 1];
        copy_items(to, flat + start * size, n, size);
        if (self->adjoint)
            memset(flat + start * size, 0, (size_t)(n * size));
        to += n * size;
    }
}

/* Add the ``bytes`` bytes of floats or doubles (``self->add``) at ``from`` into those at ``to``. */
static inline void
add_items(HaloPassObject *self, char *to, const char *from, Py_ssize_t bytes)
{
    if (self->add == ADD_DOUBLE) {
        double *t = (double *)to;
        const double *f = (const double *)from;
        for (Py_ssize_t c = 0; c < bytes / (Py_ssize_t)sizeof(double); c++)
            t[c] += f[c];
    } else {
        float *t = (float *)to;
        const float *f = (const float *)from;
        for (Py_ssize_t c = 0; c < bytes / (Py_ssize_t)sizeof(float); c++)
            t[c] += f[c];
    }
}

static void
halo_scatter(HaloPassObject *self, char *flat, const Runs *scatter, const char *from)
{
    const Py_ssize_t size = self->itemsize;
    for (Py_ssize_t r = 0; r < scatter->count; r++) {
        Py_ssize_t start = scatter->runs[2 * r], n = scatter->runs[2 * r + 1];
        Py_ssize_t k = n * size; /* bytes */
        if (self->add != ADD_NONE)
            add_items(self, flat + start * size, from, k);
        else
            copy_items(flat + start * size, from, n, size);
        from += k;
    }
}

/* A whole pass's copies to itself: forward, each ghost cell becomes its slab cell; backward, each ghost cell is added
 * into its slab cell and becomes zero, in the index maps' order (as the Python pass's ``index_add_`` adds them, after
 * what was received; a run's ghost cells are no slab cell, so each run is added whole, then zeroed). */
static void
halo_copy(HaloPassObject *self, char *flat)
{
    const Py_ssize_t size = self->itemsize;
    for (Py_ssize_t g = 0; g < self->copies.count; g++) {
        const CopyGroup *group = &self->copies.groups[g];
        char *slab = flat + group->slab * size, *ghost = flat + group->ghost * size;
        const Py_ssize_t slab_step = group->slab_step * size, ghost_step = group->ghost_step * size;
        const Py_ssize_t bytes = group->length * size;
        for (Py_ssize_t i = 0; i < group->count; i++, slab += slab_step, ghost += ghost_step) {
            if (!self->adjoint) {
                copy_items(ghost, slab, group->length, size);
                continue;
            }
            add_items(self, slab, ghost, bytes);
            memset(ghost, 0, (size_t)bytes);
        }
    }
}

/* The tensor's address argument into ``*flat``: 0, or -1 with an error (a tensor without elements may be at 0: it has
 * no cell to gather or scatter). */
static int
halo_address(PyObject *arg, char **flat)
{
    *flat = PyLong_AsVoidPtr(arg);
    return *flat == NULL && PyErr_Occurred() ? -1 : 0;
}

/* Gather and post: 1, or 0 with ``*result`` set (NotImplemented, or an MPI error code), or -1 on an error. */
static int
halo_start(HaloPassObject *self, char *flat, int whole, PyObject **result)
{
    calls_made[C_HALO_PASS]++;
    if (!gate()) {
        if (PyErr_Occurred())
            return -1;
        *result = HANDED(C_HALO_PASS, Py_NewRef(Py_NotImplemented));
        return 0;
    }
    for (Py_ssize_t i = 0; i < self->n; i++) {
        self->reqs[i] = *PyMPIRequest_Get(PyTuple_GET_ITEM(self->requests, i));
        if (self->reqs[i] == MPI_REQUEST_NULL) { /* freed: the plan is closed; Python says so */
            *result = HANDED(C_HALO_PASS, Py_NewRef(Py_NotImplemented));
            return 0;
        }
    }
    if (whole)
        halo_gather(self, flat, &self->gather_sent, self->gathered + self->gathered_at);
    else
        halo_gather(self, flat, &self->gather, self->gathered);
    int code = self->n > 0 ? MPI_Startall((int)self->n, self->reqs) : MPI_SUCCESS;
    if (code != MPI_SUCCESS) {
        *result = PyLong_FromLong(code);
        return *result == NULL ? -1 : 0;
    }
    if (whole && !self->adjoint)
        halo_copy(self, flat); /* while the messages travel: the cells it copies are no message's */
    return 1;
}

/* The class of MPI error ``code`` (``MPI_ERR_OTHER`` where the library cannot say). */
static int
error_class_of(int code)
{
    int error_class = MPI_ERR_OTHER;
    return MPI_Error_class(code, &error_class) == MPI_SUCCESS ? error_class : MPI_ERR_OTHER;
}

/* Wait, check and scatter: None when done, else what went wrong (see above). */
static PyObject *
halo_finish(HaloPassObject *self, char *flat, int whole)
{
    int code = MPI_SUCCESS, done = 0;
    if (self->n > 0) {
        for (Py_ssize_t i = 0; i < self->n; i++)
            blank_status(&self->statuses[i]);
        code = MPI_Testall((int)self->n, self->reqs, &done, self->statuses);
        if (code == MPI_SUCCESS && !done) {
            WaitRecord *record = wait_begin(self->report);
            Py_BEGIN_ALLOW_THREADS
            code = MPI_Waitall((int)self->n, self->reqs, self->statuses);
            Py_END_ALLOW_THREADS
            wait_end(record);
        }
    }
    if (code != MPI_SUCCESS && error_class_of(code) == MPI_ERR_IN_STATUS) {
        /* a receive too long first, then the first error that is not "pending" (by class, as Python judges) */
        for (Py_ssize_t j = 0; j < self->nrecv; j++) {
            int error = self->statuses[self->received[2 * j]].MPI_ERROR;
            if (error != MPI_SUCCESS && error_class_of(error) == MPI_ERR_TRUNCATE)
                return Py_BuildValue("(nn)", j, (Py_ssize_t)-1);
        }
        for (Py_ssize_t i = 0; i < self->n; i++) {
            int error = self->statuses[i].MPI_ERROR;
            if (error != MPI_SUCCESS && error_class_of(error) != MPI_ERR_PENDING) {
                code = error;
                break;
            }
        }
    }
    if (code != MPI_SUCCESS)
        return PyLong_FromLong(code);
    for (Py_ssize_t j = 0; j < self->nrecv; j++) {
        MPI_Status *status = &self->statuses[self->received[2 * j]];
        if (received_bytes(status) != self->received[2 * j + 1])
            return Py_BuildValue("(nn)", j, received_bytes(status));
    }
    if (!whole) {
        halo_scatter(self, flat, &self->scatter, self->scattered);
        Py_RETURN_NONE;
    }
    halo_scatter(self, flat, &self->scatter_received, self->scattered + self->scattered_at);
    if (self->adjoint)
        halo_copy(self, flat);
    Py_RETURN_NONE;
}

enum { HALO_RUN, HALO_START, HALO_FINISH }; /* what a call of a HaloPass does */

/* ``run``, ``start`` and ``finish`` on the tensor at address ``arg``. */
static PyObject *
halo_call(HaloPassObject *self, PyObject *arg, int which)
{
    char *flat;
    if (halo_address(arg, &flat) < 0)
        return NULL;
    if (which == HALO_FINISH)
        return halo_finish(self, flat, 0);
    PyObject *result = NULL;
    int started = halo_start(self, flat, which == HALO_RUN, &result);
    if (started != 1)
        return started == 0 ? result : NULL;
    return which == HALO_RUN ? halo_finish(self, flat, 1) : Py_NewRef(Py_None);
}

PyDoc_STRVAR(halo_run_doc, "run($self, address, /)\n--\n\n"
                           "The whole pass on the contiguous host tensor at ``address``: None, NotImplemented (the "
                           "Python pass runs it), an MPI error code, or (receive, bytes) for a wrong size.");

static PyObject *
halo_run(HaloPassObject *self, PyObject *arg)
{
    return halo_call(self, arg, HALO_RUN);
}

PyDoc_STRVAR(halo_start_doc, "start($self, address, /)\n--\n\n"
                             "Gather and post: None when posted (``finish`` completes it), else as ``run``.");

static PyObject *
halo_start_method(HaloPassObject *self, PyObject *arg)
{
    return halo_call(self, arg, HALO_START);
}

PyDoc_STRVAR(halo_finish_doc, "finish($self, address, /)\n--\n\n"
                              "Complete a pass that ``start`` posted, into the tensor at ``address``: as ``run``.");

static PyObject *
halo_finish_method(HaloPassObject *self, PyObject *arg)
{
    return halo_call(self, arg, HALO_FINISH);
}

/* An index map given as a (address, count) pair of Python ints (an int64 array the caller keeps alive while this
 * reads it) made into runs: 0, or -1 with an error. */
static int
halo_index(PyObject *pair, const long long **index, Py_ssize_t *count)
{
    PyObject *a, *n;
    if (!PyArg_ParseTuple(pair, "OO", &a, &n))
        return -1;
    *index = PyLong_AsVoidPtr(a);
    *count = PyLong_AsSsize_t(n);
    if (PyErr_Occurred())
        return -1;
    if (*count < 0 || (*count > 0 && *index == NULL)) {
        PyErr_SetString(PyExc_ValueError, "HaloPass: a bad index map");
        return -1;
    }
    return 0;
}

/* ``count`` flat indices at ``index`` as runs: 0, or -1 with an error. */
static int
halo_runs(const long long *index, Py_ssize_t count, Runs *out)
{
    out->runs = PyMem_Malloc(2 * (size_t)count * sizeof(Py_ssize_t) + 1);
    if (out->runs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    out->count = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t *last = out->runs + 2 * (out->count - 1);
        if (out->count > 0 && index[i] == last[0] + last[1])
            last[1]++;
        else {
            out->runs[2 * out->count] = (Py_ssize_t)index[i];
            out->runs[2 * out->count + 1] = 1;
            out->count++;
        }
    }
    return 0;
}

/* The ``count`` pairs (``slabs[i]``, ``ghosts[i]``) as groups of runs: 0, or -1 with an error. */
static int
halo_copies(const long long *slabs, const long long *ghosts, Py_ssize_t count, Copies *out)
{
    out->groups = PyMem_Malloc((size_t)count * sizeof(CopyGroup) + 1);
    if (out->groups == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    out->count = 0;
    CopyGroup run = {0, 0, 0, 1, 0, 0};
    for (Py_ssize_t i = 0; i <= count; i++) {
        if (i < count && run.length > 0 && slabs[i] == run.slab + run.length && ghosts[i] == run.ghost + run.length) {
            run.length++;
            continue;
        }
        if (run.length > 0) { /* a run is over: it extends the last group, or starts one */
            CopyGroup *last = out->count > 0 ? &out->groups[out->count - 1] : NULL;
            if (last != NULL && last->length == run.length &&
                (last->count == 1 || (run.slab == last->slab + last->count * last->slab_step &&
                                      run.ghost == last->ghost + last->count * last->ghost_step))) {
                if (last->count == 1) {
                    last->slab_step = run.slab - last->slab;
                    last->ghost_step = run.ghost - last->ghost;
                }
                last->count++;
            } else
                out->groups[out->count++] = run;
        }
        if (i < count)
            run = (CopyGroup){(Py_ssize_t)slabs[i], (Py_ssize_t)ghosts[i], 1, 1, 0, 0};
    }
    return 0;
}

static PyObject *
halo_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"requests", "receives", "gather",     "gathered", "scatter", "scattered", "itemsize",
                               "adjoint",  "add",      "components", "keep",     "report",  "selfs",     NULL};
    PyObject *requests, *receives, *gather, *gathered, *scatter, *scattered, *keep, *report;
    const char *adds = NULL; /* None: copy; "f": add floats; "d": add doubles */
    int itemsize, adjoint, components;
    Py_ssize_t selfs; /* how many cells it sends to itself: the end of the slabs, the start of the ghosts */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!OO!OipziOOn:HaloPass", keywords, &PyTuple_Type, &requests,
                                     &PyTuple_Type, &receives, &PyTuple_Type, &gather, &gathered, &PyTuple_Type,
                                     &scatter, &scattered, &itemsize, &adjoint, &adds, &components, &keep, &report,
                                     &selfs))
        return NULL;
    int add = adds == NULL ? ADD_NONE : strcmp(adds, "f") == 0 ? ADD_FLOAT : strcmp(adds, "d") == 0 ? ADD_DOUBLE : -1;
    if (itemsize < 1 || add < 0 || components < 1 || (adjoint != 0) != (add != ADD_NONE) ||
        (add != ADD_NONE &&
         (size_t)itemsize != (size_t)components * (add == ADD_FLOAT ? sizeof(float) : sizeof(double)))) {
        PyErr_SetString(PyExc_ValueError, "HaloPass: bad itemsize, add or components (a backward pass adds)");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(requests), nrecv = PyTuple_GET_SIZE(receives);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(requests, i), &PyMPIPrequest_Type)) {
            PyErr_SetString(PyExc_TypeError, "HaloPass: requests must be persistent requests");
            return NULL;
        }
    HaloPassObject *self = (HaloPassObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->requests = Py_NewRef(requests);
    self->keep = Py_NewRef(keep);
    self->report = Py_NewRef(report);
    self->n = n;
    self->nrecv = nrecv;
    self->reqs = PyMem_Calloc((size_t)n + 1, sizeof(MPI_Request));
    self->statuses = PyMem_Calloc((size_t)n + 1, sizeof(MPI_Status));
    self->received = PyMem_Calloc(2 * (size_t)nrecv + 1, sizeof(Py_ssize_t));
    if (self->reqs == NULL || self->statuses == NULL || self->received == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t j = 0; j < nrecv; j++)
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(receives, j), "nn", &self->received[2 * j],
                              &self->received[2 * j + 1]) ||
            self->received[2 * j] < 0 || self->received[2 * j] >= n) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "HaloPass: a receive's index is out of range");
            Py_DECREF(self);
            return NULL;
        }
    self->gathered = PyLong_AsVoidPtr(gathered);
    self->scattered = PyLong_AsVoidPtr(scattered);
    const long long *from, *into;
    Py_ssize_t nfrom, ninto;
    if (PyErr_Occurred() || halo_index(gather, &from, &nfrom) < 0 || halo_index(scatter, &into, &ninto) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    if (selfs < 0 || selfs > nfrom || selfs > ninto) {
        PyErr_SetString(PyExc_ValueError, "HaloPass: more cells sent to itself than gathered or scattered");
        Py_DECREF(self);
        return NULL;
    }
    /* forward: the slabs gathered end with the cells sent to itself, the ghosts scattered begin with them; backward
     * the other way round */
    const long long *slabs = selfs == 0 ? NULL : adjoint ? into + ninto - selfs : from + nfrom - selfs;
    const long long *ghosts = adjoint ? from : into;
    const long long *sent = adjoint && selfs > 0 ? from + selfs : from; /* no arithmetic on an empty map's NULL */
    const long long *received = !adjoint && selfs > 0 ? into + selfs : into;
    if (halo_runs(from, nfrom, &self->gather) < 0 || halo_runs(into, ninto, &self->scatter) < 0 ||
        halo_runs(sent, nfrom - selfs, &self->gather_sent) < 0 ||
        halo_runs(received, ninto - selfs, &self->scatter_received) < 0 ||
        halo_copies(slabs, ghosts, selfs, &self->copies) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->gathered_at = adjoint ? selfs * itemsize : 0;
    self->scattered_at = adjoint ? 0 : selfs * itemsize;
    self->itemsize = itemsize;
    self->adjoint = adjoint;
    self->add = add;
    return (PyObject *)self;
}

static void
halo_dealloc(HaloPassObject *self)
{
    Py_XDECREF(self->requests);
    Py_XDECREF(self->keep);
    Py_XDECREF(self->report);
    PyMem_Free(self->reqs);
    PyMem_Free(self->statuses);
    PyMem_Free(self->received);
    PyMem_Free(self->gather.runs);
    PyMem_Free(self->scatter.runs);
    PyMem_Free(self->gather_sent.runs);
    PyMem_Free(self->scatter_received.runs);
    PyMem_Free(self->copies.groups);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef halo_methods[] = {
    {"run", (PyCFunction)halo_run, METH_O, halo_run_doc},
    {"start", (PyCFunction)halo_start_method, METH_O, halo_start_doc},
    {"finish", (PyCFunction)halo_finish_method, METH_O, halo_finish_doc},
    {NULL},
};

static PyTypeObject HaloPass_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorplay_p2p._src.engine._accel.HaloPass",
    .tp_doc = PyDoc_STR("One pass of one slot of a differentiable halo plan, on host memory: gather, Startall, "
                        "Waitall, scatter."),
    .tp_basicsize = sizeof(HaloPassObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = halo_new,
    .tp_dealloc = (destructor)halo_dealloc,
    .tp_methods = halo_methods,
};

/* --- setup ----------------------------------------------------------------------------------------- */

/* Whether no timeout is set (whose wait the Python pass polls) and ``group`` is live: 1, 0, or -1 with an error. */
static int
halo_unhindered(PyObject *group)
{
    PyObject *timeout = PyObject_GetAttr(state, s_timeout);
    if (timeout == NULL)
        return -1;
    Py_DECREF(timeout); /* compared by identity only: None stays alive */
    return timeout == Py_None && group_live(group);
}

/* Whether the engine takes a whole pass on ``group`` now, for a caller in C or C++ that runs no Python (the native
 * autograd nodes' forward and lean adjoint, ``autograd/_native.cpp``), with the GIL held: the lean path may run
 * (``gate``) and ``halo_unhindered``: 1, 0, or -1 with an error. */
static int
halo_may_run(PyObject *group)
{
    if (!gate())
        return PyErr_Occurred() ? -1 : 0;
    return halo_unhindered(group);
}

/* The whole pass of HaloPass ``pass`` on the contiguous host tensor at ``flat``, as ``run``, for the same callers, with
 * the GIL held, once ``halo_may_run`` said yes (``halo_unhindered`` is asked again here, and ``gate`` by
 * ``halo_start``: the caller may have let other threads run since).  Returns a new reference: None, NotImplemented
 * (nothing done: the Python pass runs it then; ``engine.counts()`` has it handed over where ``run`` hands it, as for
 * requests a closed plan freed), an MPI error code or (receive, bytes), or NULL with an error. */
static PyObject *
halo_run_native(PyObject *pass, PyObject *group, void *flat)
{
    if (!PyObject_TypeCheck(pass, &HaloPass_Type)) {
        PyErr_SetString(PyExc_TypeError, "halo_run: not a HaloPass");
        return NULL;
    }
    int unhindered = halo_unhindered(group);
    if (unhindered < 0)
        return NULL;
    if (!unhindered)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *result = NULL;
    int started = halo_start((HaloPassObject *)pass, flat, 1, &result);
    if (started != 1)
        return started == 0 ? result : NULL;
    return halo_finish((HaloPassObject *)pass, flat, 1);
}

/* What the engine gives C and C++ callers that run no Python: the ``native_api`` capsule, named for its version.  A
 * caller checks the name (``NATIVE_API``) and then the version field, and declares the same struct. */
#define NATIVE_API "tensorplay_p2p._src.engine._accel.native_api"
typedef struct {
    int version; /* 1 */
    int (*halo_may_run)(PyObject *group);
    PyObject *(*halo_run)(PyObject *pass, PyObject *group, void *flat);
} NativeApi;

static const NativeApi native_api = {1, halo_may_run, halo_run_native};

/* What setup_work and setup_ops take, by keyword: one table each, so that ``contract()`` lists exactly what they
 * take.  A keyword missing or unknown is a TypeError at import, never a silent fallback. */
typedef struct {
    const char *name;
    PyObject **slot;
} Reference;

static PyObject *tag_ub_obj, *world_size_obj, *world_rank_obj; /* read into tag_ub, world_size, world_rank */

static Reference work_references[] = {
    {"work", &Work_type},          {"batch", &Batch_type},
    {"work_wait", &ref_work_wait}, {"batch_wait", &ref_batch_wait},
    {"dropped", &dropped},         {"reap_dropped", &reap_dropped},
    {"watchdog", &watchdog_dict},  {"request_null", &request_null},
    {"pending", &pending_obj},     {"done", &done_obj},
    {"failed", &failed_obj},       {"busy_error", &busy_error},
};

static Reference ops_references[] = {
    {"world", &world},
    {"group_type", &group_type},
    {"op", &Op_type},
    {"new_op", &ref_new_op},
    {"isend", &ref_isend},
    {"irecv", &ref_irecv},
    {"send", &ref_send},
    {"recv", &ref_recv},
    {"batch", &ref_batch},
    {"post_resolved", &ref_post_resolved},
    {"byte", &mpi_byte},
    {"layouts", &layouts_dict},
    {"pool_keep", &pool_keep_obj},
    {"pool_keep_bytes", &pool_keep_bytes_obj},
    {"resolvers", &resolvers},
    {"resolve", &resolve},
    {"release", &release},
    {"overlap_error", &overlap_error},
    {"failure", &failure},
    {"size_error", &size_error},
    {"state", &state},
    {"validate", &validate_dict},
    {"retired", &retired},
    {"release_retired", &release_retired},
    {"ndarray", &ndarray},
    {"mpi_exception", &mpi_exception},
    {"tag_ub", &tag_ub_obj},
    {"world_size", &world_size_obj},
    {"world_rank", &world_rank_obj},
};

static Reference collectives_references[] = {
    {"all_reduce", &ref_coll[K_ALL_REDUCE]},
    {"broadcast", &ref_coll[K_BROADCAST]},
    {"reduce", &ref_coll[K_REDUCE]},
    {"all_gather_into_tensor", &ref_coll[K_ALL_GATHER_INTO_TENSOR]},
    {"reduce_scatter_tensor", &ref_coll[K_REDUCE_SCATTER_TENSOR]},
    {"all_to_all_single", &ref_coll[K_ALL_TO_ALL_SINGLE]},
    {"barrier", &ref_coll[K_BARRIER]},
    {"all_gather", &ref_coll[K_ALL_GATHER]},
    {"gather", &ref_coll[K_GATHER]},
    {"scatter", &ref_coll[K_SCATTER]},
    {"posted", &coll_posted},
    {"recipe", &coll_recipe},
    {"stranded", &stranded},
    {"mark_refused", &mark_refused},
    {"sum", &sum_op},
};

#define COUNT(table) ((Py_ssize_t)(sizeof table / sizeof table[0]))

static int
take(const char *what, PyObject *kwargs, Reference *table, Py_ssize_t n)
{
    if (kwargs == NULL || PyDict_Size(kwargs) != n) {
        PyErr_Format(PyExc_TypeError, "%s: takes exactly %zd keyword references (see contract()), got %zd", what, n,
                     kwargs == NULL ? (Py_ssize_t)0 : PyDict_Size(kwargs));
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) /* every one checked before any is taken: nothing half set */
        if (PyDict_GetItemString(kwargs, table[i].name) == NULL) {
            PyErr_Format(PyExc_TypeError, "%s: missing %s (see contract())", what, table[i].name);
            return -1;
        }
    for (Py_ssize_t i = 0; i < n; i++)
        Py_XSETREF(*table[i].slot, Py_NewRef(PyDict_GetItemString(kwargs, table[i].name)));
    return 0;
}

static int show_reference_wait_docs(void); /* below, with the calls' */

PyDoc_STRVAR(setup_work_doc, "setup_work($module, /, **references)\n--\n\n"
                             "Give the engine the Work and BatchWork classes and the Python methods it stands in for.");

static PyObject *
setup_work(PyObject *module, PyObject *args, PyObject *kwargs)
{
    if (take("setup_work", kwargs, work_references, COUNT(work_references)) < 0)
        return NULL;
    if (!PyList_CheckExact(dropped) || !PyDict_Check(watchdog_dict) || !PyType_Check(Work_type) ||
        !PyType_IsSubtype((PyTypeObject *)Work_type, &WorkBase_Type) || !PyType_Check(Batch_type) ||
        !PyType_IsSubtype((PyTypeObject *)Batch_type, &BatchBase_Type)) {
        PyErr_SetString(PyExc_TypeError, "setup_work: unexpected reference types");
        return NULL;
    }
    if (show_reference_wait_docs() < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int show_reference_docs(void); /* below the method table, whose entries it changes */

PyDoc_STRVAR(setup_ops_doc, "setup_ops($module, /, **references)\n--\n\n"
                            "Give the engine the world group, P2POp, the Python functions it stands in for, and the "
                            "package state it reads.");

static PyObject *
setup_ops(PyObject *module, PyObject *args, PyObject *kwargs)
{
    if (take("setup_ops", kwargs, ops_references, COUNT(ops_references)) < 0)
        return NULL;
    tag_ub = PyLong_AsLong(tag_ub_obj);
    world_size = (int)PyLong_AsLong(world_size_obj);
    world_rank = (int)PyLong_AsLong(world_rank_obj);
    pool_keep = PyLong_AsSsize_t(pool_keep_obj);
    pool_keep_bytes = PyLong_AsSsize_t(pool_keep_bytes_obj);
    if (PyErr_Occurred())
        return NULL;
    if (pool_keep < 0 || pool_keep > INT_MAX || pool_keep_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "setup_ops: the packing pool's bounds must be non-negative");
        return NULL;
    }
    if (!PyDict_Check(resolvers) || !PyList_CheckExact(retired) || !PyDict_Check(validate_dict) ||
        !PyDict_Check(layouts_dict) || !PyType_Check(Op_type) ||
        !PyType_IsSubtype((PyTypeObject *)Op_type, &OpBase_Type)) {
        PyErr_SetString(PyExc_TypeError, "setup_ops: unexpected reference types");
        return NULL;
    }
    if (show_reference_docs() < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(setup_collectives_doc, "setup_collectives($module, /, **references)\n--\n\n"
                                    "Give the engine the Python collectives it stands in for, the maker of their "
                                    "handles, and the reductions' recipes.");

static PyObject *
setup_collectives(PyObject *module, PyObject *args, PyObject *kwargs)
{
    if (take("setup_collectives", kwargs, collectives_references, COUNT(collectives_references)) < 0)
        return NULL;
    if (!PyList_CheckExact(stranded) || !PyCallable_Check(coll_posted) || !PyCallable_Check(coll_recipe)) {
        PyErr_SetString(PyExc_TypeError, "setup_collectives: unexpected reference types");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(contract_doc, "contract($module, /)\n--\n\n"
                           "What the engine takes from Python: ``setup_work``, ``setup_ops`` and "
                           "``setup_collectives``'s keywords, and every "
                           "name it reads, as ``(owner, name)`` (owner None: a word for messages).");

PyDoc_STRVAR(counts_doc, "counts($module, /)\n--\n\n"
                         "For each call the engine stands in for, ``(calls, handed)``: how many calls it had, and how "
                         "many of them it handed to the Python reference.");

static PyObject *contract(PyObject *module, PyObject *unused); /* below, with the names */
static PyObject *counts(PyObject *module, PyObject *unused);

static PyMethodDef module_methods[] = {
    {"isend", (PyCFunction)(void (*)(void))lean_isend, METH_FASTCALL | METH_KEYWORDS, isend_doc},
    {"irecv", (PyCFunction)(void (*)(void))lean_irecv, METH_FASTCALL | METH_KEYWORDS, irecv_doc},
    {"send", (PyCFunction)(void (*)(void))lean_send, METH_FASTCALL | METH_KEYWORDS, send_doc},
    {"recv", (PyCFunction)(void (*)(void))lean_recv, METH_FASTCALL | METH_KEYWORDS, recv_doc},
    {"batch_isend_irecv", (PyCFunction)(void (*)(void))lean_batch, METH_FASTCALL | METH_KEYWORDS, batch_doc},
    {"new_op", (PyCFunction)(void (*)(void))new_op, METH_FASTCALL, new_op_doc},
    {"waiting", (PyCFunction)waiting, METH_NOARGS, waiting_doc},
    {"setup_work", (PyCFunction)(void (*)(void))setup_work, METH_VARARGS | METH_KEYWORDS, setup_work_doc},
    {"setup_ops", (PyCFunction)(void (*)(void))setup_ops, METH_VARARGS | METH_KEYWORDS, setup_ops_doc},
    {"setup_collectives", (PyCFunction)(void (*)(void))setup_collectives, METH_VARARGS | METH_KEYWORDS,
     setup_collectives_doc},
    {"contract", contract, METH_NOARGS, contract_doc},
    {"counts", counts, METH_NOARGS, counts_doc},
    {"packing_counts", packing_counts, METH_NOARGS, packing_counts_doc},
    {"packing_trim", packing_trim, METH_NOARGS, packing_trim_doc},
    {NULL},
};

/* The docstring of each call and method the engine stands in for: its text signature (the C header, up to and
 * including "\n--\n\n", which inspect.signature reads) followed by the docstring of its Python reference, cleaned
 * as inspect.getdoc cleans it, so that help() shows the one docstring, declared in Python.  The short C text is the
 * fallback, for a reference without a docstring (python -OO).  A builtin function's or method descriptor's __doc__
 * reads ml_doc at each access, so the functions and types already made show the new text. */
static PyObject *shown_docs[7]; /* bytes: the ml_doc of the i-th entry below points into shown_docs[i] */

static int
show_reference_doc(PyMethodDef *table, const char *name, const char *own, PyObject *reference, PyObject **slot)
{
    PyMethodDef *def = table;
    while (def->ml_name != NULL && strcmp(def->ml_name, name) != 0)
        def++;
    if (def->ml_name == NULL) {
        PyErr_Format(PyExc_SystemError, "no method %s to document", name);
        return -1;
    }
    /* Anything short of that keeps the C text and never fails the import: a docstring is not worth a broken engine
     * (a Python built without docstrings has no text signature here, a reference's __doc__ may raise). */
    const char *end = strstr(own, "\n--\n\n");
    PyObject *shown = NULL;
    PyObject *inspect = end == NULL ? NULL : PyImport_ImportModule("inspect");
    PyObject *doc = inspect == NULL ? NULL : PyObject_GetAttrString(reference, "__doc__");
    PyObject *clean = doc != NULL && PyUnicode_Check(doc) ? PyObject_CallMethod(inspect, "cleandoc", "O", doc) : NULL;
    PyObject *text = clean != NULL && PyUnicode_Check(clean) && PyUnicode_GET_LENGTH(clean) > 0
                         ? PyUnicode_AsUTF8String(clean)
                         : NULL;
    if (text != NULL) {
        shown = PyBytes_FromStringAndSize(own, end + 5 - own);
        if (shown != NULL)
            PyBytes_Concat(&shown, text); /* on failure: shown is NULL */
    }
    Py_XDECREF(text);
    Py_XDECREF(clean);
    Py_XDECREF(doc);
    Py_XDECREF(inspect);
    PyErr_Clear();
    def->ml_doc = shown != NULL ? PyBytes_AS_STRING(shown) : own;
    Py_XSETREF(*slot, shown); /* the previous text, if any, released once nothing points into it */
    return 0;
}

static int
show_reference_docs(void)
{
    static const char *const names[] = {"isend", "irecv", "send", "recv", "batch_isend_irecv"};
    static const char *const own[] = {isend_doc, irecv_doc, send_doc, recv_doc, batch_doc};
    PyObject *const references[] = {ref_isend, ref_irecv, ref_send, ref_recv, ref_batch};
    for (int i = 0; i < 5; i++)
        if (show_reference_doc(module_methods, names[i], own[i], references[i], &shown_docs[i]) < 0)
            return -1;
    return 0;
}

static int
show_reference_wait_docs(void)
{
    if (show_reference_doc(work_methods, "wait", work_wait_doc, ref_work_wait, &shown_docs[5]) < 0 ||
        show_reference_doc(batch_methods, "wait", batch_wait_doc, ref_batch_wait, &shown_docs[6]) < 0)
        return -1;
    return 0;
}

/* Every name the engine reads from Python, and what it reads it on: one table, interned at import and listed by
 * ``contract()``, so that tests/engine/test_contract.py checks that each resolves.  Without that, a rename on the
 * Python side would move calls off the compiled path without a word (``gate`` takes a missing flag as "not lean"). */
typedef struct {
    PyObject **slot;
    const char *text;
    const char *owner; /* what it is read on, as the contract test names it; NULL: a word for messages */
} Name;

static Name names[] = {
    {&s_checked, "checked", "settings.state"},
    {&s_active, "active", "process.watchdog"},
    {&s_untrack, "untrack", "process.watchdog"},
    {&s_single_threaded, "single_threaded", "p2p.validate"},
    {&s_communicator, "communicator", "ProcessGroup"},
    {&s_global_of, "global_of", "ProcessGroup"},
    {&s_group_of, "group_of", "ProcessGroup"},
    {&s_fail, "fail", "Work"},
    {&s_complete, "complete", "Work"},
    {&s_wait, "wait", "Work"},
    {&s_source_rank, "source_rank", "Work"},
    {&s_finish, "_finish", "BatchWork"},
    {&s_withdraw, "_withdraw", "BatchWork"},
    {&s_profiler_module, "torch.autograd.profiler", "sys.modules"},
    {&s_profiler_flag, "_is_profiler_enabled", "torch.autograd.profiler"},
    {&s_batch_what, "batch_isend_irecv", NULL},
    {&s_isend_what, "isend", NULL},
    {&s_irecv_what, "irecv", NULL},
    {&s_send_what, "send", NULL},
    {&s_recv_what, "recv", NULL},
    {&s_steps, "steps", "ProcessGroup"},
    {&s_calls, "calls", "ProcessGroup"},
    {&s_oversubscribed, "oversubscribed", "settings.state"},
    {&s_dtype, "dtype", "tensors"},
    {&s_shape, "shape", "tensors"},
    {&s_pack_max, "PACK_MAX", "memory.layouts"},
    {&s_timeout, "timeout", "settings.state"},
    {&coll_what[K_ALL_REDUCE], "all_reduce", NULL},
    {&coll_what[K_BROADCAST], "broadcast", NULL},
    {&coll_what[K_REDUCE], "reduce", NULL},
    {&coll_what[K_ALL_GATHER_INTO_TENSOR], "all_gather_into_tensor", NULL},
    {&coll_what[K_REDUCE_SCATTER_TENSOR], "reduce_scatter_tensor", NULL},
    {&coll_what[K_ALL_TO_ALL_SINGLE], "all_to_all_single", NULL},
    {&coll_what[K_BARRIER], "barrier", NULL},
    {&coll_what[K_ALL_GATHER], "all_gather", NULL},
    {&coll_what[K_GATHER], "gather", NULL},
    {&coll_what[K_SCATTER], "scatter", NULL},
};

static PyObject *
references_tuple(Reference *table, Py_ssize_t n)
{
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t != NULL && i < n; i++) {
        PyObject *name = PyUnicode_FromString(table[i].name);
        if (name == NULL)
            Py_CLEAR(t);
        else
            PyTuple_SET_ITEM(t, i, name);
    }
    return t;
}

static PyObject *
contract(PyObject *module, PyObject *unused)
{
    PyObject *attributes = PyTuple_New(COUNT(names));
    for (Py_ssize_t i = 0; attributes != NULL && i < COUNT(names); i++) {
        PyObject *pair = names[i].owner ? Py_BuildValue("(ss)", names[i].owner, names[i].text)
                                        : Py_BuildValue("(Os)", Py_None, names[i].text);
        if (pair == NULL)
            Py_CLEAR(attributes);
        else
            PyTuple_SET_ITEM(attributes, i, pair);
    }
    PyObject *work = references_tuple(work_references, COUNT(work_references));
    PyObject *ops = references_tuple(ops_references, COUNT(ops_references));
    PyObject *collectives = references_tuple(collectives_references, COUNT(collectives_references));
    PyObject *result = attributes && work && ops && collectives
                           ? Py_BuildValue("{sOsOsOsO}", "setup_work", work, "setup_ops", ops, "setup_collectives",
                                           collectives, "names", attributes)
                           : NULL;
    Py_XDECREF(collectives);
    Py_XDECREF(attributes);
    Py_XDECREF(work);
    Py_XDECREF(ops);
    return result;
}

static PyObject *
counts(PyObject *module, PyObject *unused)
{
    PyObject *result = PyDict_New();
    for (int i = 0; result != NULL && i < C_CALLS; i++) {
        PyObject *pair = Py_BuildValue("(nn)", calls_made[i], calls_handed[i]);
        if (pair == NULL || PyDict_SetItemString(result, call_names[i], pair) < 0)
            Py_CLEAR(result);
        Py_XDECREF(pair);
    }
    return result;
}

static struct PyModuleDef accel_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_accel",
    .m_doc = "The compiled engine of tensorplay_p2p: the hot path of point-to-point calls and collectives over "
             "mpi4py's C API.",
    .m_size = -1,
    .m_methods = module_methods,
};

static int
intern(PyObject **slot, const char *text)
{
    *slot = PyUnicode_InternFromString(text);
    return *slot == NULL ? -1 : 0;
}

PyMODINIT_FUNC
PyInit__accel(void)
{
    if (import_mpi4py() < 0)
        return NULL;
    OpBase_Type.tp_base = &PyTuple_Type;
    BatchBase_Type.tp_base = &PyList_Type;
    BatchBase_Type.tp_new = PyList_Type.tp_new;
    work_getset_init();
    if (PyType_Ready(&WorkBase_Type) < 0 || PyType_Ready(&BatchBase_Type) < 0 || PyType_Ready(&OpBase_Type) < 0 ||
        PyType_Ready(&Collective_Type) < 0 || PyType_Ready(&Packed_Type) < 0 || PyType_Ready(&HaloPass_Type) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < COUNT(names); i++)
        if (intern(names[i].slot, names[i].text) < 0)
            return NULL;
    one_obj = PyLong_FromLong(1);
    if (one_obj == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&accel_module);
    if (m == NULL)
        return NULL;
    lean_isend_obj = PyObject_GetAttrString(m, "isend");
    lean_irecv_obj = PyObject_GetAttrString(m, "irecv");
    if (lean_isend_obj == NULL || lean_irecv_obj == NULL || PyModule_AddStringConstant(m, "ABI", TP2P_ABI) < 0 ||
        PyModule_AddObjectRef(m, "WorkBase", (PyObject *)&WorkBase_Type) < 0 ||
        PyModule_AddObjectRef(m, "BatchBase", (PyObject *)&BatchBase_Type) < 0 ||
        PyModule_AddObjectRef(m, "OpBase", (PyObject *)&OpBase_Type) < 0 ||
        PyModule_AddObjectRef(m, "HaloPass", (PyObject *)&HaloPass_Type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *api = PyCapsule_New((void *)&native_api, NATIVE_API, NULL);
    int api_added = api != NULL ? PyModule_AddObjectRef(m, "native_api", api) : -1;
    Py_XDECREF(api);
    if (api_added < 0) {
        Py_DECREF(m);
        return NULL;
    }
    for (int k = 0; k < K_KINDS; k++) {
        PyObject *collective = new_collective(k);
        int added = collective != NULL ? PyModule_AddObjectRef(m, call_names[coll_calls[k]], collective) : -1;
        Py_XDECREF(collective);
        if (added < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
