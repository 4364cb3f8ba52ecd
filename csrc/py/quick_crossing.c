/* SPDX-License-Identifier: Apache-2.0 */
/* The small allreduce across hosts of one rank per host, in one C call: part of csrc/py/quick_calls.c, which includes
 * this file after its shared helpers.
 *
 * With one rank per host the torus's small path (shmcomm/algorithms/torus2d.py, Torus._small) is: scale the input
 * into the agreement's message, run the agreement's rounds with the data riding in them, scale the result out. The
 * rounds are in C already (csrc/mpi/crossing.c); the Python from the public call to them and back cost as much as
 * MPI's whole allreduce of 2 KiB takes between two hosts (benchmarks/RESULTS.md). This takes that path for a numpy
 * array, with the same signature (description.Collective.signature, hashed as Python hashes it), the same kernels in
 * the same order, and so the same bits and verdicts as the full path, which ranks may take for any call. */
#include "py/quick_crossing.h"

typedef int (*crossing_rounds_fn)(uintptr_t comm_address, const int* peers, const int* kinds, int rounds, int my_rank,
                                  void* message, void* incoming, uint64_t capacity, uint64_t nbytes, uint64_t count,
                                  int code, int op, uintptr_t reduce, double timeout_s, int* late_round);

enum { CROSSING_HEADER_BYTES = 32, CROSSING_OK = 0 };

/* Collective.signature(count, divisor, True) of describe("allreduce", dtype, shape, op, prescale, postscale): the
 * hash of (kind, dtype, shape, op, prescale, postscale, root -1, count, divisor, True). 0 with *ok = 0 where Python
 * could not build it. */
static uint64_t crossing_signature(int dtype, const Py_buffer* view, long op, double prescale, double postscale,
                                   uint64_t count, long divisor, int* ok) {
  PyObject* shape = PyTuple_New(view->ndim);
  PyObject* key = PyTuple_New(10);
  *ok = 0;
  if (shape == NULL || key == NULL) goto fail;
  for (int d = 0; d < view->ndim; d++) {
    PyObject* n = PyLong_FromSsize_t(view->shape[d]);
    if (n == NULL || PyTuple_SetItem(shape, d, n) != 0) goto fail;
  }
  PyObject* items[10] = {PyLong_FromLong(SMC_COLL_ALLREDUCE), PyLong_FromLong(dtype), shape, PyLong_FromLong(op),
                         PyFloat_FromDouble(prescale), PyFloat_FromDouble(postscale), PyLong_FromLong(-1),
                         PyLong_FromUnsignedLongLong(count), PyLong_FromLong(divisor), PyBool_FromLong(1)};
  shape = NULL; /* the key owns it from here */
  int built = 1;
  for (int i = 0; i < 10; i++) { /* SetItem steals each reference, also a NULL's place, so all go in */
    built &= items[i] != NULL;
    if (items[i] != NULL && PyTuple_SetItem(key, i, items[i]) != 0) built = 0;
  }
  if (!built) goto fail;
  Py_hash_t h = PyObject_Hash(key);
  Py_DECREF(key);
  if (h == -1 && PyErr_Occurred()) return 0;
  *ok = 1;
  return (uint64_t)h;
fail:
  Py_XDECREF(shape);
  Py_XDECREF(key);
  return 0;
}

/* crossing_allreduce(call address, x, out, op, prescale, postscale): out is x itself or an array of x's type, dtype
 * and shape. Returns the result; NotImplemented where the full path must decide (nothing was sent then); a tuple
 * (status, culprit) when the ranks' verdict was not OK; or the rounds' failure code as an int (crossing.h), with the
 * round in call->late_round. */
static PyObject* quick_crossing_allreduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 6) return not_here();
  smc_crossing_call_t* call = PyLong_AsVoidPtr(args[0]);
  PyObject *x = args[1], *out = args[2];
  long horovod_op = horovod_number(args[3]);
  double prescale = PyFloat_AsDouble(args[4]), postscale = PyFloat_AsDouble(args[5]);
  if (PyErr_Occurred() || call == NULL || horovod_op < 0 || !*call->usable[0] || !*call->usable[1])
    return not_here();
  Py_buffer in, view;
  int dtype, ok = 0;
  uint64_t tag;
  if (!take_arrays(x, out, &in, &view, &dtype, &tag)) return not_here();
  const uint64_t nbytes = (uint64_t)in.len, count = nbytes / (uint64_t)in.itemsize;
  const long divisor = horovod_op == 0 ? call->world_size : 1;
  /* 16-bit floats are carried as float32 by the full path; an empty array is its business too */
  uint64_t sig = dtype == SMC_FLOAT16 || nbytes == 0 || nbytes < call->min_bytes || nbytes > call->max_bytes ||
                 nbytes > call->capacity ? 0 : crossing_signature(dtype, &in, horovod_op, prescale, postscale, count,
                                                                  divisor, &ok);
  if (!ok) {
    if (out != x) PyBuffer_Release(&view);
    PyBuffer_Release(&in);
    return not_here();
  }
  uint64_t* words = call->message;
  uint8_t* data = (uint8_t*)call->message + CROSSING_HEADER_BYTES;
  const smc_redop_t op = core_op(horovod_op);
  int rc;
  Py_BEGIN_ALLOW_THREADS
  /* The row step of a row of one (smc_allreduce of a communicator of one), then the agreement's header. */
  const void* src[1] = {in.buf};
  rc = smc_reduce(data, src, 1, (size_t)count, (smc_datatype_t)dtype, op, prescale, 1.0, 1);
  if (rc == SMC_SUCCESS) {
    words[0] = sig;
    words[1] = CROSSING_OK;
    words[2] = 0;
    words[3] = nbytes;
    rc = ((crossing_rounds_fn)call->rounds)(call->mpi_comm, call->peers, call->kinds, call->count, call->rank,
                                            call->message, call->incoming, call->capacity, nbytes, count, dtype, op,
                                            (uintptr_t)&smc_reduce, call->timeout_s, &call->late_round);
    if (rc == 0 && words[1] == CROSSING_OK) { /* Agreement.allreduce's scaling, then the torus's copy out */
      const void* result[1] = {data};
      if (postscale != 1.0 || divisor != 1)
        smc_reduce(data, result, 1, (size_t)count, (smc_datatype_t)dtype, SMC_SUM, 1.0, postscale, divisor);
      memcpy(view.buf, data, (size_t)nbytes);
    }
  } else {
    rc = -2; /* not sent: the full path says what is wrong */
  }
  Py_END_ALLOW_THREADS
  if (out != x) PyBuffer_Release(&view);
  PyBuffer_Release(&in);
  if (rc == -2) return not_here();
  if (rc != 0) return PyLong_FromLong(rc);
  if (words[1] != CROSSING_OK) return Py_BuildValue("(KK)", (unsigned long long)words[1], (unsigned long long)words[2]);
  Py_INCREF(out);
  return out;
}
