/* memkv_vllm._copy_pieces: direct mode's staging <-> KV-cache copies, one call per batch.

   copy_pieces(fn, kind, stream, dst, src, sizes): for each i, fn(dst[i], src[i], sizes[i], kind,
   stream), the three arrays of native uint64 (numpy's, built by memkv_vllm/direct/copies.py
   `PieceCopier`), with the GIL released for the whole loop. `fn` is the address of the CUDA
   runtime's cudaMemcpyAsync (same signature: dst, src, count, kind, stream -> cudaError_t), found
   in the runtime torch loaded; 0 means this module's own memcpy (CPU tensors). Why: a batch is
   thousands of pieces (a chunk is one piece per KV tensor), and each torch call from Python
   re-takes the GIL, which the worker shares with vLLM's scheduler loop at TP=1.

   copy_pieces(..., batch_fn, runtime_version, device): where batch_fn is not 0 (the runtime's
   cudaMemcpyBatchAsync, CUDA 12.8+), all pieces go to the GPU in ONE call of it instead: the
   loop's cost is the runtime's per-call work (about 7-12 us a piece on an H100, 64k pieces in a
   32k-token load). Its signature lost the failIdx argument in CUDA 13, so runtime_version (that
   runtime's cudaRuntimeGetVersion) picks the form. Every piece is ordered on `stream` (which must
   not be the legacy default stream: the worker's side streams are not). Where the batch call
   fails, the loop copies every piece (a copy is idempotent; stream order holds) and the call
   returns the batch's error code, so that the caller stops trying it; else it returns 0.

   The caller checks every piece against its tensors' bounds before calling: a pointer here is
   trusted. The first piece whose call returns non-zero stops the loop (RuntimeError naming it). */

#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030B0000
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef int (*copy_fn)(void *dst, const void *src, size_t count, int kind, void *stream);

/* The CUDA runtime's cudaMemLocation and cudaMemcpyAttributes (driver_types.h, 12.8+): no CUDA
   header is needed to build this module. */
struct mem_location {
    int type; /* cudaMemLocationType: 1 device, 2 host */
    int id;
};
struct memcpy_attributes {
    int src_access_order; /* cudaMemcpySrcAccessOrder: 1 stream (sources read in stream order) */
    struct mem_location src_hint, dst_hint;
    unsigned int flags;
};
typedef int (*batch_fn_12)(void **dsts, void **srcs, size_t *sizes, size_t count, struct memcpy_attributes *attrs,
                           size_t *attr_idxs, size_t num_attrs, size_t *fail_idx, void *stream);
typedef int (*batch_fn_13)(void **dsts, void **srcs, size_t *sizes, size_t count, struct memcpy_attributes *attrs,
                           size_t *attr_idxs, size_t num_attrs, void *stream);
enum { HOST_TO_DEVICE = 1, DEVICE_TO_HOST = 2 }; /* cudaMemcpyKind */

static int host_copy(void *dst, const void *src, size_t count, int kind, void *stream) {
    (void)kind;
    (void)stream;
    memcpy(dst, src, count);
    return 0;
}

static PyObject *copy_pieces(PyObject *self, PyObject *args) {
    unsigned long long fn_addr, stream, batch_addr = 0;
    int kind, version = 0, device = 0;
    Py_buffer dst, src, sizes;
    (void)self;
    if (!PyArg_ParseTuple(args, "KiKy*y*y*|Kii", &fn_addr, &kind, &stream, &dst, &src, &sizes, &batch_addr, &version,
                          &device))
        return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len || dst.len != sizes.len || dst.len % 8) {
        PyErr_SetString(PyExc_ValueError, "copy_pieces: dst, src and sizes must be uint64 arrays of one length");
        goto out;
    }
    Py_ssize_t n = dst.len / 8, failed = -1;
    int rc = 0, batch_rc = 0;
    const uint64_t *d = (const uint64_t *)dst.buf, *s = (const uint64_t *)src.buf, *z = (const uint64_t *)sizes.buf;
    copy_fn fn = fn_addr ? (copy_fn)(uintptr_t)fn_addr : host_copy;
    Py_BEGIN_ALLOW_THREADS
    if (batch_addr && n > 0) {
        /* uint64 arrays are void* and size_t arrays on the 64-bit hosts this builds for. */
        struct mem_location host = {2, 0}, gpu = {1, device};
        struct memcpy_attributes attrs = {1, kind == DEVICE_TO_HOST ? gpu : host, kind == DEVICE_TO_HOST ? host : gpu, 0};
        size_t attr_idx = 0, fail_idx = 0;
        if (version >= 13000)
            batch_rc = ((batch_fn_13)(uintptr_t)batch_addr)((void **)d, (void **)s, (size_t *)z, (size_t)n, &attrs,
                                                            &attr_idx, 1, (void *)(uintptr_t)stream);
        else
            batch_rc = ((batch_fn_12)(uintptr_t)batch_addr)((void **)d, (void **)s, (size_t *)z, (size_t)n, &attrs,
                                                            &attr_idx, 1, &fail_idx, (void *)(uintptr_t)stream);
    }
    for (Py_ssize_t i = 0; i < n && (!batch_addr || batch_rc); i++) {
        rc = fn((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)z[i], kind,
                (void *)(uintptr_t)stream);
        if (rc) {
            failed = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (failed >= 0) {
        PyErr_Format(PyExc_RuntimeError, "copy_pieces: piece %zd of %zd (%llu bytes) failed with error %d",
                     failed, n, (unsigned long long)z[failed], rc);
        goto out;
    }
    result = PyLong_FromLong(batch_rc);
out:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_pieces", copy_pieces, METH_VARARGS,
     "copy_pieces(fn, kind, stream, dst, src, sizes[, batch_fn, runtime_version, device]): fn(dst[i], src[i], "
     "sizes[i], kind, stream) for each i, or one batch_fn call for all, without the GIL; fn 0: memcpy. Returns the "
     "batch call's error code (0: none or not tried)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy_pieces", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy_pieces(void) { return PyModule_Create(&module); }
