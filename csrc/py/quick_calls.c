/* SPDX-License-Identifier: Apache-2.0 */
/* The common case of the smallest collectives as CPython functions: a numpy array, straight to the core.
 *
 * A small allreduce takes about a microsecond in the core; the Python around it (wrapping the arrays, the checks,
 * the calls between layers) took several. These functions take the arrays themselves (METH_FASTCALL), get their
 * memory through the buffer protocol (which refuses what the core must not get: a non-contiguous array, or a
 * read-only one to write), and call the core with the interpreter lock released, as cffi's calls do.
 *
 * Each is bound to its communicator (the PyCFunction's self, see BOUND_ITEMS), so that callers hold a function and no
 * address. Each returns the result, or NotImplemented where anything is out of the ordinary (a dtype the core does not
 * reduce, an output that does not fit, an op it does not know): the caller then takes the full path, whose checks
 * say what is wrong. A failed step returns its return code as an int, and the caller raises the core's error.
 *
 * This file is compiled into the cffi module (csrc/ffi_build.py includes it), where Python.h is available; the core
 * itself never includes Python. It needs the buffer protocol of the limited API, which Python has from 3.11; older
 * builds compile it out and smc_quick_method returns NULL. */
#if !defined(Py_LIMITED_API) || Py_LIMITED_API + 0 >= 0x030B0000
#define SMC_QUICK_CALLS 1

/* What a quick function is bound to (the self of its PyCFunction: transport/shm.py's SharedMemory._bound), a list:
 * the communicator's address (0 once it is closed), its size, this rank's index, the addresses of the uint64_t
 * arrays every[size], sends[size], matrix[size * size] and counts[size], and numpy.empty. */
enum { BOUND_COMM, BOUND_SIZE, BOUND_RANK, BOUND_EVERY, BOUND_SENDS, BOUND_MATRIX, BOUND_COUNTS, BOUND_EMPTY,
       BOUND_ITEMS };
#define BOUND(self, item) PyList_GetItem(self, item) /* borrowed; bound() checked the list's length */

static int bound(PyObject* self, Py_ssize_t items) {
  return self != NULL && PyList_CheckExact(self) && PyList_Size(self) == items;
}

/* The core's dtype of a buffer's single-character native format, or -1. */
static int quick_dtype(const Py_buffer* view) {
  const char* f = view->format;
  if (f == NULL || f[0] == 0 || f[1] != 0) return -1; /* a byte-order prefix or a struct: the full path decides */
  switch (f[0]) {
    case 'e': return view->itemsize == 2 ? SMC_FLOAT16 : -1;
    case 'f': return view->itemsize == 4 ? SMC_FLOAT32 : -1;
    case 'd': return view->itemsize == 8 ? SMC_FLOAT64 : -1;
    case 'b': return view->itemsize == 1 ? SMC_INT8 : -1;
    case 'B': return view->itemsize == 1 ? SMC_UINT8 : -1;
    case 'h': return view->itemsize == 2 ? SMC_INT16 : -1;
    case 'i': case 'l': case 'q':
      return view->itemsize == 4 ? SMC_INT32 : view->itemsize == 8 ? SMC_INT64 : -1;
    default: return -1;
  }
}

/* description.tag in C: smc_shape_tag of the dtype and shape[from:] (from 1: the collectives whose first dimension
 * may differ between ranks). *ok = 0 for more dimensions than a buffer may have. */
static uint64_t quick_tag(int dtype, const Py_buffer* view, int from, int* ok) {
  int64_t dims[PyBUF_MAX_NDIM];
  const int ndim = view->ndim - from;
  *ok = ndim >= 0 && ndim <= PyBUF_MAX_NDIM;
  if (!*ok) return 0;
  for (int d = 0; d < ndim; d++) dims[d] = (int64_t)view->shape[from + d];
  return smc_shape_tag(dtype, dims, ndim);
}

static int same_layout(const Py_buffer* a, const Py_buffer* b) {
  if (a->ndim != b->ndim || a->itemsize != b->itemsize || a->len != b->len || strcmp(a->format, b->format) != 0)
    return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}

static PyObject* not_here(void) {
  PyErr_Clear();
  Py_INCREF(Py_NotImplemented);
  return Py_NotImplemented;
}

/* The output's buffer: x's own (out is x), or out's when it has x's layout. 0 where the full path must decide. */
static int output_view(PyObject* x, Py_buffer* in, PyObject* out, Py_buffer* view) {
  if (out == x) {
    *view = *in;
    return 1;
  }
  if (Py_TYPE(out) != Py_TYPE(x)) return 0;
  if (PyObject_GetBuffer(out, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0) return 0;
  if (!same_layout(in, view)) {
    PyBuffer_Release(view);
    return 0;
  }
  return 1;
}

/* x's buffer with its core dtype and tag, and the output's buffer (x's own where out is x). */
typedef struct {
  Py_buffer in, view;
  int dtype;
  uint64_t tag;
} arrays_t;

/* 1, or 0 with nothing held where the full path must decide. */
static int take_arrays(PyObject* x, PyObject* out, arrays_t* a) {
  if (PyObject_GetBuffer(x, &a->in, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (out == x ? PyBUF_WRITABLE : 0)) != 0)
    return 0;
  int ok = 0;
  a->dtype = quick_dtype(&a->in); /* broadcast too: for the types the core reduces, the dtype key is the code */
  a->tag = a->dtype < 0 ? 0 : quick_tag(a->dtype, &a->in, 0, &ok);
  if (!ok || !output_view(x, &a->in, out, &a->view)) {
    PyBuffer_Release(&a->in);
    return 0;
  }
  return 1;
}

/* Horovod's number of an element-wise op (ops.ReduceOp: 0 Average, 1 Sum, 3 Min, 4 Max, 5 Product; None is Average),
 * or -1 for anything else (Adasum, 2, is not element-wise). */
static long horovod_number(PyObject* op) {
  if (op == Py_None) return 0;
  if (!PyLong_Check(op)) return -1;
  long n = PyLong_AsLong(op);
  return n == 0 || n == 1 || n == 3 || n == 4 || n == 5 ? n : -1;
}

static smc_redop_t core_op(long horovod_op) {
  return horovod_op == 3 ? SMC_MIN : horovod_op == 4 ? SMC_MAX : horovod_op == 5 ? SMC_PROD : SMC_SUM;
}

static PyObject* finish(PyObject* x, Py_buffer* in, PyObject* out, Py_buffer* view, smc_result_t rc) {
  if (out != x) PyBuffer_Release(view);
  PyBuffer_Release(in);
  if (rc != SMC_SUCCESS) return PyLong_FromLong(rc);
  Py_INCREF(out);
  return out;
}

/* allreduce(x, out, op, prescale, postscale[, dtype]): op is Horovod's number (ops.ReduceOp, or None for Average);
 * out is x itself or an array of x's type, dtype and shape. `dtype`, None or SMC_BFLOAT16, says that int16 arrays
 * hold bfloat16 elements (numpy has none: a bfloat16 tensor comes as an int16 view of its memory). */
static PyObject* quick_allreduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if ((nargs != 5 && nargs != 6) || !bound(self, BOUND_ITEMS)) return not_here();
  smc_comm_t* comm = PyLong_AsVoidPtr(BOUND(self, BOUND_COMM));
  long size = PyLong_AsLong(BOUND(self, BOUND_SIZE));
  PyObject *x = args[0], *out = args[1], *op = args[2];
  long horovod_op = horovod_number(op);
  double prescale = PyFloat_AsDouble(args[3]), postscale = PyFloat_AsDouble(args[4]);
  if (PyErr_Occurred() || comm == NULL || size < 1 || horovod_op < 0) return not_here();
  arrays_t a;
  if (!take_arrays(x, out, &a)) return not_here();
  if (nargs == 6 && args[5] != Py_None) {
    int ok = PyLong_AsLong(args[5]) == SMC_BFLOAT16 && a.dtype == SMC_INT16;
    if (ok) a.tag = quick_tag(a.dtype = SMC_BFLOAT16, &a.in, 0, &ok);
    if (!ok) {
      if (out != x) PyBuffer_Release(&a.view);
      PyBuffer_Release(&a.in);
      return not_here();
    }
  }
  smc_result_t rc;
  Py_BEGIN_ALLOW_THREADS
  rc = smc_allreduce(comm, a.in.buf, a.view.buf, (size_t)(a.in.len / a.in.itemsize), (smc_datatype_t)a.dtype,
                     core_op(horovod_op), prescale, postscale, horovod_op == 0 ? (double)size : 1.0, a.tag);
  Py_END_ALLOW_THREADS
  return finish(x, &a.in, out, &a.view, rc);
}

/* broadcast(x, out, root index): out is x itself or an array of x's type, dtype and shape. */
static PyObject* quick_broadcast(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !bound(self, BOUND_ITEMS)) return not_here();
  smc_comm_t* comm = PyLong_AsVoidPtr(BOUND(self, BOUND_COMM));
  PyObject *x = args[0], *out = args[1];
  long root = PyLong_AsLong(args[2]);
  if (PyErr_Occurred() || comm == NULL || root < 0) return not_here();
  arrays_t a;
  if (!take_arrays(x, out, &a)) return not_here();
  smc_result_t rc;
  Py_BEGIN_ALLOW_THREADS
  rc = smc_broadcast(comm, a.in.buf, a.view.buf, (size_t)a.in.len, (int)root, a.tag);
  Py_END_ALLOW_THREADS
  return finish(x, &a.in, out, &a.view, rc);
}

#include "py/quick_rows.c"
#include "py/quick_crossing.c"

static PyMethodDef smc_quick_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))quick_allreduce, METH_FASTCALL,
     "allreduce(x, out, op, prescale, postscale): the result, NotImplemented, or a failed step's code"},
    {"broadcast", (PyCFunction)(void (*)(void))quick_broadcast, METH_FASTCALL,
     "broadcast(x, out, root): the result, NotImplemented, or a failed step's code"},
    {"allgather", (PyCFunction)(void (*)(void))quick_allgather, METH_FASTCALL,
     "allgather(x, out): the result, None (out did not fit), NotImplemented, or a failed step's code"},
    {"alltoall", (PyCFunction)(void (*)(void))quick_alltoall, METH_FASTCALL,
     "alltoall(x, out, splits): (the result, rows from each rank) (the result alone without splits), None (out did "
     "not fit), NotImplemented, or a failed step's code"},
    {"reducescatter", (PyCFunction)(void (*)(void))quick_reducescatter, METH_FASTCALL,
     "reducescatter(x, out, op, prescale, postscale): the result, NotImplemented, or a failed step's code"},
    {"crossing_allreduce", (PyCFunction)(void (*)(void))quick_crossing_allreduce, METH_FASTCALL,
     "crossing_allreduce(x, out, op, prescale, postscale): the result, NotImplemented, (status, culprit) of a "
     "verdict not OK, or the rounds' failure code"},
};
#endif

void* smc_quick_method(int which) {
#ifdef SMC_QUICK_CALLS
  if (which >= 0 && which < (int)(sizeof(smc_quick_methods) / sizeof(smc_quick_methods[0])))
    return &smc_quick_methods[which];
#endif
  (void)which;
  return NULL;
}
