/* memkv_vllm._copy_pieces: direct mode's staging <-> KV-cache copies, one call per batch.

   copy_pieces(fn, kind, stream, dst, src, sizes): for each i, fn(dst[i], src[i], sizes[i], kind,
   stream), the three arrays of native uint64 (numpy's, built by memkv_vllm/direct/copies.py
   `PieceCopier`), with the GIL released for the whole loop. `fn` is the address of the CUDA
   runtime's cudaMemcpyAsync (same signature: dst, src, count, kind, stream -> cudaError_t), found
   in the runtime torch loaded; 0 means this module's own memcpy (CPU tensors). Why: a batch is
   thousands of pieces (a chunk is one piece per KV tensor), and each torch call from Python
   re-takes the GIL, which the worker shares with vLLM's scheduler loop at TP=1.

   The caller checks every piece against its tensors' bounds before calling: a pointer here is
   trusted. The first piece whose call returns non-zero stops the loop (RuntimeError naming it). */

#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030B0000
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef int (*copy_fn)(void *dst, const void *src, size_t count, int kind, void *stream);

static int host_copy(void *dst, const void *src, size_t count, int kind, void *stream) {
    (void)kind;
    (void)stream;
    memcpy(dst, src, count);
    return 0;
}

static PyObject *copy_pieces(PyObject *self, PyObject *args) {
    unsigned long long fn_addr, stream;
    int kind;
    Py_buffer dst, src, sizes;
    (void)self;
    if (!PyArg_ParseTuple(args, "KiKy*y*y*", &fn_addr, &kind, &stream, &dst, &src, &sizes))
        return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len || dst.len != sizes.len || dst.len % 8) {
        PyErr_SetString(PyExc_ValueError, "copy_pieces: dst, src and sizes must be uint64 arrays of one length");
        goto out;
    }
    Py_ssize_t n = dst.len / 8, failed = -1;
    int rc = 0;
    const uint64_t *d = (const uint64_t *)dst.buf, *s = (const uint64_t *)src.buf, *z = (const uint64_t *)sizes.buf;
    copy_fn fn = fn_addr ? (copy_fn)(uintptr_t)fn_addr : host_copy;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
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
    result = Py_None;
    Py_INCREF(result);
out:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_pieces", copy_pieces, METH_VARARGS,
     "copy_pieces(fn, kind, stream, dst, src, sizes): fn(dst[i], src[i], sizes[i], kind, stream) for each i, "
     "without the GIL; fn 0: memcpy"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy_pieces", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy_pieces(void) { return PyModule_Create(&module); }
