/* memkv._recv_verify: receive a value from a TCP socket and hash it with xxh3-128, piece by
 * piece, in one call that holds no GIL.
 *
 * Why it exists (docs/performance.md, "A compiled receive-and-verify loop"): the pure-Python
 * loop hashes each 256 KiB piece right after its receive, while the kernel's copy left it in
 * cache, but each piece costs two GIL hand-offs; with many receiving threads in a busy process
 * (vLLM's engine core) that cost more than the cache saved, so there the value is received whole
 * and hashed from DRAM afterwards. Here the whole value is one GIL release: in-cache hashing
 * with no hand-offs. The digest is the same xxh3-128 as memkv.integrity's (python-xxhash, which
 * bundles the same xxHash release); the Python fallback stays the reference.
 *
 * recv_xxh3_into(fd, buffer, piece_bytes, deadline) -> (got, errno, digest)
 *   fd: a blocking socket (SO_RCVTIMEO bounds each receive); buffer: writable, contiguous.
 *   deadline: a time.monotonic() instant (CLOCK_MONOTONIC), or a negative number for none;
 *   the receive timeout is cut to the time left at most every 50 ms, as memkv.sockio does.
 *   Returns got == len(buffer), errno 0 and the 16-byte digest when the value arrived whole;
 *   otherwise got < len(buffer), digest None and errno: 0 (peer closed), EAGAIN (timeout or
 *   deadline), or the receive's errno. A signal interrupts the loop only to run Python's
 *   handlers (PEP 475); an exception they raise propagates.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>

/* xxHash from the system's header (Debian/Ubuntu: libxxhash-dev), inlined: no copy of it in this
 * tree, nothing linked. This unit assumes only the build's baseline (SSE2 on x86-64). */
#define XXH_INLINE_ALL
#include <xxhash.h>

/* The update loop is the one place where the vector width pays (SSE2 hashes at about a third of
 * AVX2's speed): chosen once, at import, from what the CPU has (csrc/xxh3_avx2.c). The state's
 * layout does not depend on it, so reset and digest stay here. */
typedef void (*xxh3_update_fn)(XXH3_state_t *, const void *, size_t);

static void xxh3_update_baseline(XXH3_state_t *state, const void *data, size_t len) {
    (void)XXH3_128bits_update(state, data, len);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEMKV_XXH3_AVX2 1
void memkv_xxh3_update_avx2(XXH3_state_t *state, const void *data, size_t len);
#endif

static xxh3_update_fn xxh3_update = xxh3_update_baseline;
static const char *xxh3_variant = "baseline";

static void choose_xxh3_update(void) {
#if defined(MEMKV_XXH3_AVX2)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        xxh3_update = memkv_xxh3_update_avx2;
        xxh3_variant = "avx2";
    }
#endif
}

#define REARM_S 0.05

static double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Cut SO_RCVTIMEO to the time left; 0 when the deadline has passed. */
static int arm(int fd, double deadline) {
    double left = deadline - monotonic_s();
    if (left <= 0) {
        return 0;
    }
    if (left < 0.001) {
        left = 0.001; /* a zero timeval would mean "no timeout" */
    }
    struct timeval tv;
    tv.tv_sec = (time_t)left;
    tv.tv_usec = (suseconds_t)((left - (double)tv.tv_sec) * 1e6);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return 1;
}

/* A fresh xxh3-128 state, or NULL with MemoryError set (the caller releases its buffer). */
static XXH3_state_t *new_state(void) {
    XXH3_state_t *state = XXH3_createState();
    if (state == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    XXH3_128bits_reset(state);
    return state;
}

static PyObject *recv_xxh3_into(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    PyObject *target;
    Py_ssize_t piece;
    double deadline;
    if (!PyArg_ParseTuple(args, "iOnd", &fd, &target, &piece, &deadline)) {
        return NULL;
    }
    if (piece <= 0) {
        PyErr_SetString(PyExc_ValueError, "piece_bytes must be positive");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(target, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    XXH3_state_t *state = new_state();
    if (state == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }

    char *base = (char *)view.buf;
    size_t total = (size_t)view.len;
    size_t got = 0;    /* bytes received */
    size_t hashed = 0; /* bytes hashed: always a prefix of what was received */
    int err = 0;
    int closed = 0;
    int failed = 0; /* a Python signal handler raised */
    double armed = -1.0;

    Py_BEGIN_ALLOW_THREADS
    while (got < total) {
        if (deadline >= 0 && monotonic_s() - armed > REARM_S) {
            armed = monotonic_s();
            if (!arm(fd, deadline)) {
                err = EAGAIN;
                break;
            }
        }
        size_t want = total - got < (size_t)piece ? total - got : (size_t)piece;
        ssize_t n = recv(fd, base + got, want, MSG_WAITALL);
        if (n > 0) {
            got += (size_t)n;
            xxh3_update(state, base + hashed, (size_t)(got - hashed));
            hashed = got;
            continue;
        }
        if (n == 0) {
            closed = 1;
            break;
        }
        if (errno == EINTR) {
            int raised;
            Py_BLOCK_THREADS
            raised = PyErr_CheckSignals();
            Py_UNBLOCK_THREADS
            if (raised < 0) {
                failed = 1;
                break;
            }
            continue;
        }
        err = errno == EWOULDBLOCK ? EAGAIN : errno;
        break;
    }
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&view);
    if (failed) {
        XXH3_freeState(state);
        return NULL;
    }
    PyObject *digest;
    if (got == total && !closed && err == 0) {
        XXH128_canonical_t canon;
        XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(state));
        digest = PyBytes_FromStringAndSize((const char *)canon.digest, sizeof canon.digest);
        if (digest == NULL) {
            XXH3_freeState(state);
            return NULL;
        }
    } else {
        digest = Py_None;
        Py_INCREF(digest);
    }
    XXH3_freeState(state);
    return Py_BuildValue("niN", (Py_ssize_t)got, err, digest);
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14 */
#endif

static PyObject *copy_xxh3(PyObject *self, PyObject *args) {
    /* copy_xxh3(target, source, piece_bytes, populate=0) -> digest: copy `source` into `target`
     * (same length) piece by piece, hashing each piece of the copy right after it was written
     * (in cache), with no GIL: the one-copy load of a same-host node's shared memory
     * (memkv/client/shared.py). The digest is of the bytes in `target`: what was copied is what
     * was verified, whatever the source does meanwhile. `populate`: first fill the page tables
     * of the source's pages (madvise MADV_POPULATE_READ; an error leaves the copy to fault them
     * in), inside the same GIL release: a busy process makes every re-acquire costly. */
    (void)self;
    PyObject *target_obj, *source_obj;
    Py_ssize_t piece;
    int populate = 0;
    if (!PyArg_ParseTuple(args, "OOn|p", &target_obj, &source_obj, &piece, &populate)) {
        return NULL;
    }
    if (piece <= 0) {
        PyErr_SetString(PyExc_ValueError, "piece_bytes must be positive");
        return NULL;
    }
    Py_buffer target, source;
    if (PyObject_GetBuffer(target_obj, &target, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(source_obj, &source, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&target);
        return NULL;
    }
    if (source.len != target.len) {
        PyBuffer_Release(&source);
        PyBuffer_Release(&target);
        PyErr_SetString(PyExc_ValueError, "source and target differ in length");
        return NULL;
    }
    XXH3_state_t *state = new_state();
    if (state == NULL) {
        PyBuffer_Release(&source);
        PyBuffer_Release(&target);
        return NULL;
    }
    char *dst = (char *)target.buf;
    const char *src = (const char *)source.buf;
    size_t total = (size_t)target.len;
    Py_BEGIN_ALLOW_THREADS
    if (populate && total > 0) {
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t start = (uintptr_t)src & ~(page - 1);
        (void)madvise((void *)start, (uintptr_t)src + total - start, MADV_POPULATE_READ);
    }
    for (size_t off = 0; off < total; off += (size_t)piece) {
        size_t n = total - off < (size_t)piece ? total - off : (size_t)piece;
        memcpy(dst + off, src + off, n);
        xxh3_update(state, dst + off, n);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&source);
    PyBuffer_Release(&target);
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(state));
    XXH3_freeState(state);
    return PyBytes_FromStringAndSize((const char *)canon.digest, sizeof canon.digest);
}

static PyObject *read_xxh3(PyObject *self, PyObject *args) {
    /* read_xxh3(fd, target, piece_bytes) -> digest or None: pread the first len(target) bytes
     * of the file `fd` into `target` piece by piece, hashing each piece right after the kernel
     * copied it (in cache), with no GIL: the load of a memfd a same-host node passed
     * (memkv/client/shared.py). Reading rather than mapping takes no lock of the process's
     * address space: loader threads of one process mapping and unmapping values serialize on
     * it. None when the file holds fewer bytes (or a read fails: errno set). */
    (void)self;
    int fd;
    PyObject *target_obj;
    Py_ssize_t piece;
    if (!PyArg_ParseTuple(args, "iOn", &fd, &target_obj, &piece)) {
        return NULL;
    }
    if (piece <= 0) {
        PyErr_SetString(PyExc_ValueError, "piece_bytes must be positive");
        return NULL;
    }
    Py_buffer target;
    if (PyObject_GetBuffer(target_obj, &target, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    XXH3_state_t *state = new_state();
    if (state == NULL) {
        PyBuffer_Release(&target);
        return NULL;
    }
    char *dst = (char *)target.buf;
    size_t total = (size_t)target.len;
    size_t got = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (got < total) {
        size_t want = total - got < (size_t)piece ? total - got : (size_t)piece;
        ssize_t n = pread(fd, dst + got, want, (off_t)got);
        if (n > 0) {
            xxh3_update(state, dst + got, (size_t)n);
            got += (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            err = n < 0 ? errno : 0;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&target);
    if (got < total) {
        XXH3_freeState(state);
        if (err != 0) {
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        Py_RETURN_NONE;
    }
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(state));
    XXH3_freeState(state);
    return PyBytes_FromStringAndSize((const char *)canon.digest, sizeof canon.digest);
}

static PyObject *write_xxh3(PyObject *self, PyObject *args) {
    /* write_xxh3(fd, source, piece_bytes) -> digest: pwrite `source` at offset 0 of the file
     * `fd` piece by piece, each piece first copied into a small buffer and hashed there (in
     * cache), with no GIL: the store into a memfd a same-host node passed
     * (memkv/client/shared.py). The digest is of the bytes written, whatever the source does
     * meanwhile. OSError (errno of the write) when a write fails. */
    (void)self;
    int fd;
    PyObject *source_obj;
    Py_ssize_t piece;
    if (!PyArg_ParseTuple(args, "iOn", &fd, &source_obj, &piece)) {
        return NULL;
    }
    if (piece <= 0) {
        PyErr_SetString(PyExc_ValueError, "piece_bytes must be positive");
        return NULL;
    }
    Py_buffer source;
    if (PyObject_GetBuffer(source_obj, &source, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    size_t total = (size_t)source.len;
    size_t bounce_bytes = total < (size_t)piece ? (total > 0 ? total : 1) : (size_t)piece;
    char *bounce = malloc(bounce_bytes);
    XXH3_state_t *state = bounce == NULL ? NULL : new_state();
    if (state == NULL) {
        free(bounce);
        PyBuffer_Release(&source);
        return bounce == NULL ? PyErr_NoMemory() : NULL;
    }
    const char *src = (const char *)source.buf;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t off = 0; off < total && err == 0; off += bounce_bytes) {
        size_t n = total - off < bounce_bytes ? total - off : bounce_bytes;
        memcpy(bounce, src + off, n);
        xxh3_update(state, bounce, n);
        size_t done = 0;
        while (done < n) {
            ssize_t w = pwrite(fd, bounce + done, n - done, (off_t)(off + done));
            if (w > 0) {
                done += (size_t)w;
            } else if (w < 0 && errno == EINTR) {
                continue;
            } else {
                err = w < 0 ? errno : EIO;
                break;
            }
        }
    }
    Py_END_ALLOW_THREADS
    free(bounce);
    PyBuffer_Release(&source);
    if (err != 0) {
        XXH3_freeState(state);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(state));
    XXH3_freeState(state);
    return PyBytes_FromStringAndSize((const char *)canon.digest, sizeof canon.digest);
}

static PyObject *xxh3_128_digest(PyObject *self, PyObject *args) {
    /* The one-shot digest of this build, for the tests that hold it to python-xxhash's:
     * through the update loop chosen at import, or the baseline one when `baseline` is true
     * (so that both are held to it on a CPU that picks AVX2). */
    (void)self;
    Py_buffer view;
    int baseline = 0;
    if (!PyArg_ParseTuple(args, "y*|p", &view, &baseline)) {
        return NULL;
    }
    xxh3_update_fn update = baseline ? xxh3_update_baseline : xxh3_update;
    XXH3_state_t *state = new_state();
    if (state == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    update(state, view.buf, (size_t)view.len);
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(state));
    XXH3_freeState(state);
    PyBuffer_Release(&view);
    return PyBytes_FromStringAndSize((const char *)canon.digest, sizeof canon.digest);
}

static PyMethodDef methods[] = {
    {"recv_xxh3_into", recv_xxh3_into, METH_VARARGS,
     "recv_xxh3_into(fd, buffer, piece_bytes, deadline) -> (got, errno, digest or None)"},
    {"copy_xxh3", copy_xxh3, METH_VARARGS,
     "copy_xxh3(target, source, piece_bytes, populate=False) -> digest of the copy (16 bytes)"},
    {"read_xxh3", read_xxh3, METH_VARARGS,
     "read_xxh3(fd, target, piece_bytes) -> digest of what was read (16 bytes), or None when short"},
    {"write_xxh3", write_xxh3, METH_VARARGS,
     "write_xxh3(fd, source, piece_bytes) -> digest of what was written (16 bytes)"},
    {"xxh3_128_digest", xxh3_128_digest, METH_VARARGS, "xxh3_128_digest(data, baseline=False) -> 16 bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "memkv._recv_verify",
    "Receive a value and hash it with xxh3-128 in one call without the GIL.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__recv_verify(void) {
    choose_xxh3_update();
    PyObject *m = PyModule_Create(&module);
    /* Which update loop this CPU runs ("avx2" or "baseline"), for tests and benchmarks. */
    if (m != NULL && PyModule_AddStringConstant(m, "XXH3_VARIANT", xxh3_variant) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
