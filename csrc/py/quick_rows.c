/* SPDX-License-Identifier: Apache-2.0 */
/* The quick calls of the collectives whose inputs are rows (allgather, alltoall, reducescatter): part of
 * csrc/py/quick_calls.c, which includes this file after its shared helpers (quick_dtype, quick_tag, horovod_number,
 * core_op, not_here, finish). */
/* ---- Allgather, alltoall and reducescatter ----
 * Each works out what the full path works out in Python (the tag, the counts, the result's shape) and takes both
 * steps in one call. `empty` is numpy.empty, called for a result the caller did not give; the uint64_t arrays named
 * by address are the communicator's own (algorithms/host.py), reused by every call. */

/* The buffer of `out` when it can take rows like x's: x's type and format, writable and contiguous, and x's trailing
 * dimensions. 0 otherwise (nothing held). */
static int rows_output(PyObject* x, const Py_buffer* in, PyObject* out, Py_buffer* view) {
  if (out == x || Py_TYPE(out) != Py_TYPE(x)) return 0;
  if (PyObject_GetBuffer(out, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0) {
    PyErr_Clear();
    return 0;
  }
  int same = view->ndim == in->ndim && view->itemsize == in->itemsize && strcmp(view->format, in->format) == 0;
  for (int d = 1; same && d < in->ndim; d++) same = view->shape[d] == in->shape[d];
  if (!same) PyBuffer_Release(view);
  return same;
}

/* x's buffer, of at least one dimension and a dtype the core knows, the bytes of one of its rows, and the tag of its
 * trailing dimensions (from 1) or of its whole shape (from 0). 0 (nothing held) where the full path must decide. */
static int rows_input(PyObject* x, Py_buffer* in, uint64_t* row_bytes, int tag_from, uint64_t* tag) {
  if (PyObject_GetBuffer(x, in, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return 0;
  int ok = 0, dtype = in->ndim < 1 ? -1 : quick_dtype(in);
  if (dtype >= 0) *tag = quick_tag(dtype, in, tag_from, &ok);
  if (!ok) {
    PyBuffer_Release(in);
    return 0;
  }
  *row_bytes = (uint64_t)in->itemsize;
  for (int d = 1; d < in->ndim; d++) *row_bytes *= (uint64_t)in->shape[d];
  return 1;
}

/* What allgather and alltoall hold between their steps: x's buffer and, where out can take rows like x's, out's
 * (have_view); the bytes of a row and the tag of x's trailing dimensions; the rows the result has (total) and whether
 * out's buffer has them (fits). */
typedef struct {
  Py_buffer in, view;
  int have_view, fits;
  uint64_t row_bytes, tag, total;
} rows_call_t;

/* x's rows and out's buffer into r; 0 (nothing held) where the full path must decide: x is not rows the core knows,
 * or out is neither None nor an output of rows like x's, whatever their number. */
static int take_rows(PyObject* x, PyObject* out, rows_call_t* r) {
  if (!rows_input(x, &r->in, &r->row_bytes, 1, &r->tag)) return 0;
  r->have_view = out != Py_None && rows_output(x, &r->in, out, &r->view);
  r->fits = 0;
  r->total = 0;
  if (out != Py_None && !r->have_view) {
    PyBuffer_Release(&r->in);
    return 0;
  }
  return 1;
}

/* After a first step that filled `counts`: the result's rows, the sum of counts[j * stride + offset] over the ranks,
 * and the second step at once (without the interpreter) where out's buffer has them. */
static smc_result_t finish_if_fits(smc_result_t (*step)(smc_comm_t*, const void*, void*, uint64_t, const uint64_t*),
                                   smc_comm_t* comm, rows_call_t* r, const uint64_t* counts, long size, long stride,
                                   long offset) {
  for (long j = 0; j < size; j++) r->total += counts[j * stride + offset];
  r->fits = r->have_view && (uint64_t)r->view.shape[0] == r->total;
  return r->fits ? step(comm, r->in.buf, r->view.buf, r->row_bytes, counts) : SMC_SUCCESS;
}

/* A new array from empty((rows,) + x's trailing dimensions, x.dtype), with its buffer in *view; NULL with Python's
 * error set where that failed. */
static PyObject* new_rows(PyObject* empty, PyObject* x, const Py_buffer* in, uint64_t rows, Py_buffer* view) {
  PyObject *shape = PyTuple_New(in->ndim), *dtype = PyObject_GetAttrString(x, "dtype"), *out = NULL;
  int built = shape != NULL && dtype != NULL;
  for (int d = 0; built && d < in->ndim; d++) {
    PyObject* n = d == 0 ? PyLong_FromUnsignedLongLong(rows) : PyLong_FromSsize_t(in->shape[d]);
    built = n != NULL && PyTuple_SetItem(shape, d, n) == 0;
  }
  if (built) out = PyObject_CallFunctionObjArgs(empty, shape, dtype, NULL);
  Py_XDECREF(shape);
  Py_XDECREF(dtype);
  if (out != NULL && PyObject_GetBuffer(out, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) Py_CLEAR(out);
  return out;
}

/* What a collective whose result's rows were known only after its first step (r->total) does next: into out's buffer
 * (r->view, held) when it has that many rows; else into a new array when out is None; else (out does not fit) it
 * takes part without keeping anything, and returns None for the caller to raise the output's error. The second step
 * is taken whatever happens, so that no peer waits for this rank. Releases r's buffers. */
static PyObject* second_step(smc_result_t (*step)(smc_comm_t*, const void*, void*, uint64_t, const uint64_t*),
                             smc_comm_t* comm, PyObject* x, rows_call_t* r, PyObject* out, PyObject* empty,
                             const uint64_t* counts) {
  PyObject* result = NULL;
  int have_view = r->have_view;
  if (have_view && (uint64_t)r->view.shape[0] == r->total) {
    result = out;
    Py_INCREF(out);
  } else {
    if (have_view) PyBuffer_Release(&r->view);
    have_view = 0;
    if (out == Py_None) {
      result = new_rows(empty, x, &r->in, r->total, &r->view); /* NULL with an error set: the step below still runs */
      have_view = result != NULL;
    } else {
      result = Py_None;
      Py_INCREF(result);
    }
  }
  smc_result_t rc; /* a failed new array's error stays set meanwhile: no Python runs until it is returned */
  Py_BEGIN_ALLOW_THREADS
  rc = step(comm, r->in.buf, have_view ? r->view.buf : NULL, r->row_bytes, counts);
  Py_END_ALLOW_THREADS
  if (have_view) PyBuffer_Release(&r->view);
  PyBuffer_Release(&r->in);
  if (rc != SMC_SUCCESS) {
    Py_XDECREF(result);
    PyErr_Clear();
    return PyLong_FromLong(rc);
  }
  return result;
}

/* allgather(x, out): every rank's rows of x, concatenated, into out (None: a new array); the bound `every` takes
 * the rows of each rank. Returns the result; None where out turned out
 * not to have the rows the ranks sent (this rank took part without keeping them: the caller raises the output's
 * error, knowing the rows from `every`); NotImplemented (nothing begun); or a failed step's code. */
static PyObject* quick_allgather(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !bound(self, BOUND_ITEMS)) return not_here();
  smc_comm_t* comm = PyLong_AsVoidPtr(BOUND(self, BOUND_COMM));
  long size = PyLong_AsLong(BOUND(self, BOUND_SIZE));
  PyObject *x = args[0], *out = args[1], *empty = BOUND(self, BOUND_EMPTY);
  uint64_t* every = PyLong_AsVoidPtr(BOUND(self, BOUND_EVERY));
  if (PyErr_Occurred() || comm == NULL || every == NULL || size < 1) return not_here();
  rows_call_t r;
  if (!take_rows(x, out, &r)) return not_here();
  smc_result_t rc;
  Py_BEGIN_ALLOW_THREADS
  rc = smc_allgather_begin(comm, r.in.buf, (uint64_t)r.in.shape[0], r.row_bytes, r.tag, every);
  if (rc == SMC_SUCCESS) rc = finish_if_fits(smc_allgather_finish, comm, &r, every, size, 1, 0);
  Py_END_ALLOW_THREADS
  if (r.fits || rc != SMC_SUCCESS) return finish(x, &r.in, r.have_view ? out : x, &r.view, rc);
  return second_step(smc_allgather_finish, comm, x, &r, out, empty, every);
}

/* The rows rank j is sent, from alltoall's splits (None: an equal share each, which must divide the rows; or a list
 * or tuple of size non-negative ints adding up to the rows), into sends. 0 where the full path must decide. */
static int split_rows(PyObject* splits, long size, uint64_t rows, uint64_t* sends) {
  if (splits == Py_None) {
    if (rows % (uint64_t)size) return 0;
    for (long j = 0; j < size; j++) sends[j] = rows / (uint64_t)size;
    return 1;
  }
  int list = PyList_CheckExact(splits);
  if (!(list || PyTuple_CheckExact(splits)) || (list ? PyList_Size(splits) : PyTuple_Size(splits)) != size) return 0;
  uint64_t total = 0;
  for (long j = 0; j < size; j++) {
    PyObject* item = list ? PyList_GetItem(splits, j) : PyTuple_GetItem(splits, j); /* borrowed */
    long long n = PyLong_Check(item) ? PyLong_AsLongLong(item) : -1;
    if (n < 0 || PyErr_Occurred()) return 0;
    sends[j] = (uint64_t)n;
    total += (uint64_t)n;
  }
  return total == rows;
}

/* alltoall(x, out, splits): the bound `sends` takes the rows this rank sends each rank, `matrix` every rank's.
 * Returns (the result, the
 * rows received from each rank, a tuple), the result alone where splits is None, or as allgather does. */
static PyObject* quick_alltoall(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !bound(self, BOUND_ITEMS)) return not_here();
  smc_comm_t* comm = PyLong_AsVoidPtr(BOUND(self, BOUND_COMM));
  long size = PyLong_AsLong(BOUND(self, BOUND_SIZE)), me = PyLong_AsLong(BOUND(self, BOUND_RANK));
  PyObject *x = args[0], *out = args[1], *splits = args[2], *empty = BOUND(self, BOUND_EMPTY);
  uint64_t* sends = PyLong_AsVoidPtr(BOUND(self, BOUND_SENDS));
  uint64_t* matrix = PyLong_AsVoidPtr(BOUND(self, BOUND_MATRIX));
  if (PyErr_Occurred() || comm == NULL || sends == NULL || matrix == NULL || size < 1 || me < 0 || me >= size)
    return not_here();
  rows_call_t r;
  if (!take_rows(x, out, &r)) return not_here();
  if (!split_rows(splits, size, (uint64_t)r.in.shape[0], sends)) {
    if (r.have_view) PyBuffer_Release(&r.view);
    PyBuffer_Release(&r.in);
    return not_here();
  }
  smc_result_t rc;
  Py_BEGIN_ALLOW_THREADS
  rc = smc_alltoall_begin(comm, r.in.buf, sends, r.row_bytes, r.tag, matrix);
  if (rc == SMC_SUCCESS) rc = finish_if_fits(smc_alltoall_finish, comm, &r, matrix, size, size, me);
  Py_END_ALLOW_THREADS
  if (rc != SMC_SUCCESS) return finish(x, &r.in, r.have_view ? out : x, &r.view, rc);
  PyObject* result = r.fits ? finish(x, &r.in, out, &r.view, rc)
                            : second_step(smc_alltoall_finish, comm, x, &r, out, empty, matrix);
  if (result == NULL || result == Py_None || PyLong_Check(result) || splits == Py_None) return result;
  PyObject* got = PyTuple_New(size);
  for (long j = 0; got != NULL && j < size; j++) {
    PyObject* rows = PyLong_FromUnsignedLongLong(matrix[j * size + me]);
    if (rows == NULL || PyTuple_SetItem(got, j, rows) != 0) Py_CLEAR(got);
  }
  PyObject* pair = got == NULL ? NULL : PyTuple_Pack(2, result, got);
  Py_XDECREF(got);
  Py_DECREF(result);
  return pair; /* NULL with Python's error set: out of memory */
}

/* reducescatter(x, out, op, prescale, postscale): this rank's share of the reduction along the first dimension
 * (Horovod's split: the first rows % size ranks get a row more), into out (None: a new array); op as allreduce's;
 * the bound `counts` takes the elements of each rank's share. */
static PyObject* quick_reducescatter(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !bound(self, BOUND_ITEMS)) return not_here();
  smc_comm_t* comm = PyLong_AsVoidPtr(BOUND(self, BOUND_COMM));
  long size = PyLong_AsLong(BOUND(self, BOUND_SIZE)), me = PyLong_AsLong(BOUND(self, BOUND_RANK));
  long horovod_op = horovod_number(args[2]);
  PyObject *x = args[0], *out = args[1], *empty = BOUND(self, BOUND_EMPTY);
  double prescale = PyFloat_AsDouble(args[3]), postscale = PyFloat_AsDouble(args[4]);
  uint64_t* counts = PyLong_AsVoidPtr(BOUND(self, BOUND_COUNTS));
  if (PyErr_Occurred() || comm == NULL || counts == NULL || size < 1 || me < 0 || me >= size || horovod_op < 0)
    return not_here();
  Py_buffer in, view;
  uint64_t row_bytes, tag;
  if (!rows_input(x, &in, &row_bytes, 0, &tag)) return not_here();
  uint64_t rows = (uint64_t)in.shape[0], per_row = row_bytes / (uint64_t)in.itemsize;
  for (long j = 0; j < size; j++)
    counts[j] = (rows / (uint64_t)size + ((uint64_t)j < rows % (uint64_t)size)) * per_row;
  uint64_t mine = rows / (uint64_t)size + ((uint64_t)me < rows % (uint64_t)size);
  PyObject* result = NULL;
  if (out == Py_None) {
    result = new_rows(empty, x, &in, mine, &view);
    if (result == NULL) {
      PyBuffer_Release(&in);
      return NULL;
    }
  } else {
    int fits = rows_output(x, &in, out, &view);
    if (fits && (uint64_t)view.shape[0] != mine) {
      PyBuffer_Release(&view);
      fits = 0;
    }
    if (!fits) { /* an output that does not fit: the full path takes part with a new array, then raises */
      PyBuffer_Release(&in);
      return not_here();
    }
    result = out;
    Py_INCREF(out);
  }
  smc_result_t rc;
  Py_BEGIN_ALLOW_THREADS
  rc = smc_reducescatter(comm, in.buf, view.buf, counts, (smc_datatype_t)quick_dtype(&in), core_op(horovod_op),
                         prescale, postscale, horovod_op == 0 ? (int64_t)size : 1, tag);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&view);
  PyBuffer_Release(&in);
  if (rc != SMC_SUCCESS) {
    Py_DECREF(result);
    return PyLong_FromLong(rc);
  }
  return result;
}
