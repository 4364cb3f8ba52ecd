/* SPDX-License-Identifier: Apache-2.0 */
/* The common case of the smallest collectives as CPython functions: a numpy array, straight to the core.
 *
 * A small allreduce takes about a microsecond in the core; the Python around it (wrapping the arrays, the checks,
 * the calls between layers) took several. These functions take the arrays themselves (METH_FASTCALL), get their
 * memory through the buffer protocol (which refuses what the core must not get: a non-contiguous array, or a
 * read-only one to write), and call the core with the interpreter lock released, as cffi's calls do.
 *
 * Each returns the result, or NotImplemented where anything is out of the ordinary (a dtype the core does not
 * reduce, an output that does not fit, an op it does not know): the caller then takes the full path, whose checks
 * say what is wrong. A failed step returns its return code as an int, and the caller raises the core's error.
 *
 * This file is compiled into the cffi module (csrc/ffi_build.py includes it), where Python.h is available; the core
 * itself never includes Python. It needs the buffer protocol of the limited API, which Python has from 3.11; older
 * builds compile it out and smc_quick_method returns NULL. */
#if !defined(Py_LIMITED_API) || Py_LIMITED_API + 0 >= 0x030B0000
#define SMC_QUICK_CALLS 1

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

/* description.tag in C: hash((dtype,) + shape) of Python's own tuple hash, so that a rank on this path and one on the
 * full path agree. 0 with *ok = 0 if Python could not build the tuple. */
static uint64_t quick_tag(int dtype, const Py_buffer* view, int* ok) {
  PyObject* key = PyTuple_New(1 + view->ndim);
  *ok = 0;
  if (key == NULL) return 0;
  PyObject* item = PyLong_FromLong(dtype);
  if (item == NULL || PyTuple_SetItem(key, 0, item) != 0) goto fail;
  for (int d = 0; d < view->ndim; d++) {
    item = PyLong_FromSsize_t(view->shape[d]);
    if (item == NULL || PyTuple_SetItem(key, 1 + d, item) != 0) goto fail;
  }
  Py_hash_t h = PyObject_Hash(key);
  Py_DECREF(key);
  if (h == -1 && PyErr_Occurred()) return 0;
  *ok = 1;
  return (uint64_t)h;
fail:
  Py_DECREF(key);
  return 0;
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

/* x's buffer with its core dtype and tag, and the output's buffer (x's own where out is x): 1, or 0 with nothing held
 * where the full path must decide. */
static int take_arrays(PyObject* x, PyObject* out, Py_buffer* in, Py_buffer* view, int* dtype, uint64_t* tag) {
  if (PyObject_GetBuffer(x, in, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (out == x ? PyBUF_WRITABLE : 0)) != 0) return 0;
  int ok = 0;
  *dtype = quick_dtype(in); /* broadcast too: for the types the core reduces, the dtype key is the code */
  *tag = *dtype < 0 ? 0 : quick_tag(*dtype, in, &ok);
  if (!ok || !output_view(x, in, out, view)) {
    PyBuffer_Release(in);
    return 0;
  }
  return 1;
}

static PyObject* finish(PyObject* x, Py_buffer* in, PyObject* out, Py_buffer* view, smc_result_t rc) {
  if (out != x) PyBuffer_Release(view);
  PyBuffer_Release(in);
  if (rc != SMC_SUCCESS) return PyLong_FromLong(rc);
  Py_INCREF(out);
  return out;
}

/* allreduce(communicator address, communicator size, x, out, op, prescale, postscale): op is Horovod's number
 * (ops.ReduceOp, or None for Average); out is x itself or an array of x's type, dtype and shape. */
static PyObject* quick_allreduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 7) return not_here();
  smc_comm_t* comm = PyLong_AsVoidPtr(args[0]);
  long size = PyLong_AsLong(args[1]);
  PyObject *x = args[2], *out = args[3], *op = args[4];
  long horovod_op = op == Py_None ? 0 : PyLong_Check(op) ? PyLong_AsLong(op) : -1;
  double prescale = PyFloat_AsDouble(args[5]), postscale = PyFloat_AsDouble(args[6]);
  /* Horovod's Average, Sum, Adasum (not element-wise: never here), Min, Max, Product */
  static const int redop[] = {SMC_SUM, SMC_SUM, -1, SMC_MIN, SMC_MAX, SMC_PROD};
  if (PyErr_Occurred() || comm == NULL || size < 1 || horovod_op < 0 || horovod_op > 5 || redop[horovod_op] < 0)
    return not_here();
  Py_buffer in, view;
  int dtype;
  uint64_t tag;
  if (!take_arrays(x, out, &in, &view, &dtype, &tag)) return not_here();
  smc_result_t rc;
  Py_BEGIN_ALLOW_THREADS
  rc = smc_allreduce(comm, in.buf, view.buf, (size_t)(in.len / in.itemsize), (smc_datatype_t)dtype,
                     (smc_redop_t)redop[horovod_op], prescale, postscale, horovod_op == 0 ? (double)size : 1.0, tag);
  Py_END_ALLOW_THREADS
  return finish(x, &in, out, &view, rc);
}

/* broadcast(communicator address, x, out, root index): out is x itself or an array of x's type, dtype and shape. */
static PyObject* quick_broadcast(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 4) return not_here();
  smc_comm_t* comm = PyLong_AsVoidPtr(args[0]);
  PyObject *x = args[1], *out = args[2];
  long root = PyLong_AsLong(args[3]);
  if (PyErr_Occurred() || comm == NULL || root < 0) return not_here();
  Py_buffer in, view;
  int dtype;
  uint64_t tag;
  if (!take_arrays(x, out, &in, &view, &dtype, &tag)) return not_here();
  smc_result_t rc;
  Py_BEGIN_ALLOW_THREADS
  rc = smc_broadcast(comm, in.buf, view.buf, (size_t)in.len, (int)root, tag);
  Py_END_ALLOW_THREADS
  return finish(x, &in, out, &view, rc);
}

/* ---- Allgather, alltoall and reducescatter of arrays a rank passed before ----
 * The caller (algorithms/known_arrays.py) passes what the full path worked out for an array of this dtype and shape:
 * the tag, and for alltoall and reducescatter the counts, as addresses of uint64_t arrays it keeps. */

/* The buffer of `out` when it can take `rows` rows like x's: x's type and format, writable and contiguous, and x's
 * trailing dimensions. 0 otherwise, or when out is None, with a view that holds no object. */
static int rows_output(PyObject* x, const Py_buffer* in, PyObject* out, Py_buffer* view) {
  view->obj = NULL; /* PyBuffer_Release of such a view does nothing */
  if (out == Py_None || out == x || Py_TYPE(out) != Py_TYPE(x)) return 0;
  if (PyObject_GetBuffer(out, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0) {
    PyErr_Clear();
    view->obj = NULL;
    return 0;
  }
  int same = view->ndim == in->ndim && view->itemsize == in->itemsize && strcmp(view->format, in->format) == 0;
  for (int d = 1; same && d < in->ndim; d++) same = view->shape[d] == in->shape[d];
  if (!same) PyBuffer_Release(view); /* which leaves view->obj NULL */
  return same;
}

/* x's buffer, of at least one dimension, and the bytes of one of its rows. 0 (nothing held) where the full path
 * must decide. */
static int rows_input(PyObject* x, Py_buffer* in, uint64_t* row_bytes) {
  if (PyObject_GetBuffer(x, in, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return 0;
  if (in->ndim < 1 || quick_dtype(in) < 0) {
    PyBuffer_Release(in);
    return 0;
  }
  *row_bytes = (uint64_t)in->itemsize;
  for (int d = 1; d < in->ndim; d++) *row_bytes *= (uint64_t)in->shape[d];
  return 1;
}

/* What a begun allgather or alltoall returns: out once finished, None when begun but not finished (the output did
 * not fit or was not given: the caller finishes, with the counts the step left in its array), or a failed step's
 * code. `view` is out's buffer, or has no object (rows_output took none). */
static PyObject* begun(PyObject* x, Py_buffer* in, PyObject* out, Py_buffer* view, int finished, smc_result_t rc) {
  if (finished || rc != SMC_SUCCESS) return finish(x, in, out, view, rc);
  PyBuffer_Release(view);
  PyBuffer_Release(in);
  Py_RETURN_NONE;
}

/* allgather(address, size, x, out, every, tag): `every` the address of a uint64_t[size] for the row counts. */
static PyObject* quick_allgather(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 6) return not_here();
  smc_comm_t* comm = PyLong_AsVoidPtr(args[0]);
  long size = PyLong_AsLong(args[1]);
  PyObject *x = args[2], *out = args[3];
  uint64_t* every = PyLong_AsVoidPtr(args[4]);
  uint64_t tag = (uint64_t)PyLong_AsUnsignedLongLongMask(args[5]);
  if (PyErr_Occurred() || comm == NULL || every == NULL || size < 1) return not_here();
  Py_buffer in, view;
  uint64_t row_bytes;
  if (!rows_input(x, &in, &row_bytes)) return not_here();
  int have_out = rows_output(x, &in, out, &view), finished = 0;
  smc_result_t rc;
  Py_BEGIN_ALLOW_THREADS
  rc = smc_allgather_begin(comm, in.buf, (uint64_t)in.shape[0], row_bytes, tag, every);
  uint64_t total = 0;
  for (long j = 0; j < size; j++) total += every[j];
  if (rc == SMC_SUCCESS && have_out && total == (uint64_t)view.shape[0]) {
    rc = smc_allgather_finish(comm, in.buf, view.buf, row_bytes, every);
    finished = 1;
  }
  Py_END_ALLOW_THREADS
  return begun(x, &in, out, &view, finished, rc);
}

/* alltoall(address, size, rank, x, out, sends, matrix, tag): `sends` the address of the uint64_t[size] rows this
 * rank sends each rank, `matrix` of a uint64_t[size * size] for every rank's. Once finished, returns (out, the rows
 * received from each rank) instead of out. */
static PyObject* quick_alltoall(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 8) return not_here();
  smc_comm_t* comm = PyLong_AsVoidPtr(args[0]);
  long size = PyLong_AsLong(args[1]), me = PyLong_AsLong(args[2]);
  PyObject *x = args[3], *out = args[4];
  const uint64_t* sends = PyLong_AsVoidPtr(args[5]);
  uint64_t* matrix = PyLong_AsVoidPtr(args[6]);
  uint64_t tag = (uint64_t)PyLong_AsUnsignedLongLongMask(args[7]);
  if (PyErr_Occurred() || comm == NULL || sends == NULL || matrix == NULL || size < 1 || me < 0 || me >= size)
    return not_here();
  Py_buffer in, view;
  uint64_t row_bytes;
  if (!rows_input(x, &in, &row_bytes)) return not_here();
  int have_out = rows_output(x, &in, out, &view), finished = 0;
  smc_result_t rc;
  Py_BEGIN_ALLOW_THREADS
  rc = smc_alltoall_begin(comm, in.buf, sends, row_bytes, tag, matrix);
  uint64_t total = 0;
  for (long j = 0; j < size; j++) total += matrix[j * size + me];
  if (rc == SMC_SUCCESS && have_out && total == (uint64_t)view.shape[0]) {
    rc = smc_alltoall_finish(comm, in.buf, view.buf, row_bytes, matrix);
    finished = 1;
  }
  Py_END_ALLOW_THREADS
  PyObject* result = begun(x, &in, out, &view, finished, rc);
  if (!finished || rc != SMC_SUCCESS) return result;
  PyObject* got = PyTuple_New(size);
  for (long j = 0; got != NULL && j < size; j++) {
    PyObject* rows = PyLong_FromUnsignedLongLong(matrix[j * size + me]);
    if (rows == NULL || PyTuple_SetItem(got, j, rows) != 0) Py_CLEAR(got);
  }
  PyObject* pair = got == NULL ? NULL : PyTuple_Pack(2, out, got);
  Py_XDECREF(got);
  Py_DECREF(result);
  return pair; /* NULL with Python's error set: out of memory */
}

/* reducescatter(address, rank, x, out, counts, op, prescale, postscale, divisor, tag): `counts` the address of the
 * uint64_t[size] elements each rank receives, op the core's code; out an array of x's type that holds this rank's
 * share. */
static PyObject* quick_reducescatter(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 10) return not_here();
  smc_comm_t* comm = PyLong_AsVoidPtr(args[0]);
  long me = PyLong_AsLong(args[1]), op = PyLong_AsLong(args[5]);
  PyObject *x = args[2], *out = args[3];
  const uint64_t* counts = PyLong_AsVoidPtr(args[4]);
  double prescale = PyFloat_AsDouble(args[6]), postscale = PyFloat_AsDouble(args[7]);
  long long divisor = PyLong_AsLongLong(args[8]);
  uint64_t tag = (uint64_t)PyLong_AsUnsignedLongLongMask(args[9]);
  if (PyErr_Occurred() || comm == NULL || counts == NULL || me < 0 || op < 0 || op >= SMC_NUM_OPS || divisor < 1)
    return not_here();
  Py_buffer in, view;
  uint64_t row_bytes;
  if (!rows_input(x, &in, &row_bytes)) return not_here();
  int dtype = quick_dtype(&in);
  if (!rows_output(x, &in, out, &view)) {
    PyBuffer_Release(&in);
    return not_here();
  }
  if ((uint64_t)view.len != counts[me] * (uint64_t)in.itemsize) {
    PyBuffer_Release(&view);
    PyBuffer_Release(&in);
    return not_here();
  }
  smc_result_t rc;
  Py_BEGIN_ALLOW_THREADS
  rc = smc_reducescatter(comm, in.buf, view.buf, counts, (smc_datatype_t)dtype, (smc_redop_t)op, prescale, postscale,
                         (int64_t)divisor, tag);
  Py_END_ALLOW_THREADS
  return finish(x, &in, out, &view, rc);
}

static PyMethodDef smc_quick_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))quick_allreduce, METH_FASTCALL,
     "allreduce(address, size, x, out, op, prescale, postscale): the result, NotImplemented, or a failed step's code"},
    {"broadcast", (PyCFunction)(void (*)(void))quick_broadcast, METH_FASTCALL,
     "broadcast(address, x, out, root): the result, NotImplemented, or a failed step's code"},
    {"allgather", (PyCFunction)(void (*)(void))quick_allgather, METH_FASTCALL,
     "allgather(address, size, x, out, every, tag): out, None (begun: finish it), NotImplemented, or a code"},
    {"alltoall", (PyCFunction)(void (*)(void))quick_alltoall, METH_FASTCALL,
     "alltoall(address, size, rank, x, out, sends, matrix, tag): out, None (begun: finish it), NotImplemented, or a "
     "code"},
    {"reducescatter", (PyCFunction)(void (*)(void))quick_reducescatter, METH_FASTCALL,
     "reducescatter(address, rank, x, out, counts, op, prescale, postscale, divisor, tag): out, NotImplemented, or a "
     "failed step's code"},
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
