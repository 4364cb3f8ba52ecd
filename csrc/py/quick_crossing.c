/* SPDX-License-Identifier: Apache-2.0 */
/* The small allreduce across hosts of one rank per host, in one C call: part of csrc/py/quick_calls.c, which includes
 * this file after its shared helpers.
 *
 * The torus's small path (shmcomm/algorithms/torus2d.py, Torus._small) is: the row's allreduce into the agreement's
 * message, on the row's first rank the agreement's rounds with the data riding in them, then the row's broadcast of
 * verdict and result. Its steps are all in C (the core, and csrc/mpi/crossing.c's exchanges); the Python from the
 * public call to them and back cost as much as MPI's whole allreduce of 2 KiB between two hosts
 * (benchmarks/RESULTS.md). This takes that path for a numpy array, with the same signature
 * (description.Collective.signature, the core's smc_signature), the same kernels in the same order, and so the same
 * bits and verdicts as the full path, which ranks may take for any call. Where a step fails, it stops where the full
 * path would raise or turn to other steps, and says where (WorldComm.quick_allreduce_failed goes on from there). */
#include "py/quick_crossing.h"

/* Collective.signature(count, divisor, True) of describe("allreduce", dtype, shape, op, prescale, postscale). *ok =
 * 0 for more dimensions than a buffer may have. */
static uint64_t crossing_signature(int dtype, const Py_buffer* view, long op, double prescale, double postscale,
                                   uint64_t count, long divisor, int* ok) {
  int64_t dims[PyBUF_MAX_NDIM], extra[3] = {(int64_t)count, divisor, 1};
  *ok = view->ndim >= 0 && view->ndim <= PyBUF_MAX_NDIM;
  if (!*ok) return 0;
  for (int d = 0; d < view->ndim; d++) dims[d] = (int64_t)view->shape[d];
  return smc_signature(SMC_COLL_ALLREDUCE, dtype, dims, view->ndim, op, prescale, postscale, -1, extra, 3);
}

/* The torus's small path (Torus._small) after the caller's checks, the interpreter lock released: the row's step into
 * the agreement's message (data after the header), then on the row's first rank the rounds and the row broadcast of
 * the verdict and the result, on the others that broadcast. Returns where it stopped: DONE (the result is in `out`),
 * or the stage that failed with *rc, or VERDICT with the verdict in the message's header. */
enum { DONE, ROW_FAILED, ROUNDS_FAILED, BROADCAST_FAILED, VERDICT };

static int small_path(smc_crossing_call_t* call, const void* src, void* out, uint64_t count, uint64_t nbytes,
                      int dtype, smc_redop_t op, double prescale, double postscale, long divisor, uint64_t sig,
                      int* rc) {
  smc_comm_t* row = (smc_comm_t*)call->row;
  uint64_t* words = call->message;
  uint8_t* data = (uint8_t*)call->message + SMC_AGREEMENT_HEADER_BYTES;
  *rc = smc_allreduce(row, src, data, (size_t)count, (smc_datatype_t)dtype, op, prescale, 1.0, 1, sig);
  if (*rc != SMC_SUCCESS) return ROW_FAILED;
  if (call->row_rank == 0) {
    words[0] = sig;
    words[1] = SMC_AGREEMENT_OK;
    words[2] = 0;
    words[3] = nbytes;
    int rounds = smc_agreement_rounds((smc_exchange_fn)call->exchange, (void*)call->context, call->peers, call->kinds,
                                      call->count, call->rank, call->message, call->incoming, call->capacity, nbytes,
                                      count, dtype, op, call->timeout_s, &call->late_round);
    if (rounds != 0) { /* the row hears that this rank failed, as the full path tells it */
      words[1] = SMC_AGREEMENT_FAILED;
      words[2] = (uint64_t)call->world_rank + 1;
    } else if (words[1] == SMC_AGREEMENT_OK && (postscale != 1.0 || divisor != 1)) { /* Agreement.allreduce's scaling */
      const void* result[1] = {data};
      smc_reduce(data, result, 1, (size_t)count, (smc_datatype_t)dtype, SMC_SUM, 1.0, postscale, divisor);
    }
    int told = call->row_size > 1 ? smc_broadcast(row, call->message, call->message,
                                                  SMC_AGREEMENT_HEADER_BYTES + nbytes, 0, nbytes) : SMC_SUCCESS;
    if (rounds != 0) {
      *rc = rounds;
      return ROUNDS_FAILED;
    }
    if (told != SMC_SUCCESS) {
      *rc = told;
      return BROADCAST_FAILED;
    }
  } else {
    *rc = smc_broadcast(row, NULL, call->message, SMC_AGREEMENT_HEADER_BYTES + nbytes, 0, nbytes);
    if (*rc != SMC_SUCCESS) return BROADCAST_FAILED;
  }
  if (words[1] != SMC_AGREEMENT_OK) return VERDICT;
  memcpy(out, data, (size_t)nbytes);
  return DONE;
}

/* crossing_allreduce(x, out, op, prescale, postscale), bound to a list of its smc_crossing_call_t's address: out is x itself or an array of x's type, dtype
 * and shape. Returns the result; NotImplemented where the full path must decide (nothing was done then); or where
 * the call failed, (stage, code) for the stages "row" (the row's step, the core's code), "rounds" (crossing.h's code,
 * the round in call->late_round) and "broadcast" (the core's code), or ("verdict", status, culprit) where the
 * verdict was not OK (on a rank other than the row's first, only its row's verdict yet). */
static PyObject* quick_crossing_allreduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !bound(self, 1)) return not_here();
  smc_crossing_call_t* call = PyLong_AsVoidPtr(BOUND(self, 0));
  PyObject *x = args[0], *out = args[1];
  long horovod_op = horovod_number(args[2]);
  double prescale = PyFloat_AsDouble(args[3]), postscale = PyFloat_AsDouble(args[4]);
  if (PyErr_Occurred() || call == NULL || horovod_op < 0 || !*call->usable[0] || !*call->usable[1])
    return not_here();
  arrays_t a;
  int ok = 0;
  if (!take_arrays(x, out, &a)) return not_here();
  const uint64_t nbytes = (uint64_t)a.in.len, count = nbytes / (uint64_t)a.in.itemsize;
  const long divisor = horovod_op == 0 ? call->world_size : 1;
  /* 16-bit floats are carried as float32 by the full path; an empty array is its business too */
  uint64_t sig = a.dtype == SMC_FLOAT16 || nbytes == 0 || nbytes < call->min_bytes || nbytes > call->max_bytes ||
                 nbytes > call->capacity ? 0 : crossing_signature(a.dtype, &a.in, horovod_op, prescale, postscale,
                                                                  count, divisor, &ok);
  if (!ok) {
    if (out != x) PyBuffer_Release(&a.view);
    PyBuffer_Release(&a.in);
    return not_here();
  }
  int stage, rc = 0;
  Py_BEGIN_ALLOW_THREADS
  stage = small_path(call, a.in.buf, a.view.buf, count, nbytes, a.dtype, core_op(horovod_op), prescale, postscale,
                     divisor, sig, &rc);
  Py_END_ALLOW_THREADS
  if (out != x) PyBuffer_Release(&a.view);
  PyBuffer_Release(&a.in);
  const uint64_t* words = call->message;
  switch (stage) {
    case DONE: Py_INCREF(out); return out;
    case ROW_FAILED: return Py_BuildValue("(si)", "row", rc);
    case ROUNDS_FAILED: return Py_BuildValue("(si)", "rounds", rc);
    case BROADCAST_FAILED: return Py_BuildValue("(si)", "broadcast", rc);
    default: return Py_BuildValue("(sKK)", "verdict", (unsigned long long)words[1], (unsigned long long)words[2]);
  }
}
