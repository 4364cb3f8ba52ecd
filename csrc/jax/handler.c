/* SPDX-License-Identifier: Apache-2.0
 *
 * handler.c: the XLA FFI handler behind every collective of shmcomm.jax, written against XLA's C API
 * (xla/ffi/api/c_api.h from jaxlib's include folder), for the CPU.
 *
 * One handler serves every collective; its attributes say which (shmcomm/jax/primitive.py writes them):

 *   context, pid      the process's smc_jax_context_t and the pid it belongs to
 *   kind            smc_coll_kind_t;  dtype: smc_datatype_t;  op: ReduceOp;  c_op: smc_redop_t;  divisor
 *   root, tag       root index; the 64-bit digest of what the core's descriptor does not hold (the shapes)
 *   prescale, postscale (f64)
 *   rows, sends     per-rank row counts (see smc_jax_call_t)
 *   name            how errors name the call
 * Operands: the array (none for a barrier), then the ordering token; results likewise.
 *
 * On one host with no engine running, it calls the core's collective itself: no Python, no copy. Otherwise (across
 * hosts, where the torus and the MPI transport live in Python, or while the engine orders collectives) it hands the
 * decoded call to Python (smc_jax_python), which runs it through the same communicator as the numpy API. After a
 * failure of the core it asks Python to explain it (the numpy API's messages, every rank's shape), and returns the
 * text as the XLA error.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "xla/ffi/api/c_api.h"
#include "handler.h"

/* Defined by cffi (extern "Python+C" in shmcomm/jax/native.py). */
int smc_jax_python(smc_jax_context_t* ctx, smc_jax_call_t* call);

static XLA_FFI_Error* fail(const XLA_FFI_CallFrame* frame, XLA_FFI_Error_Code code, const char* message) {
  XLA_FFI_Error_Create_Args args;
  memset(&args, 0, sizeof(args));
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = message;
  args.errc = code;
  return frame->api->XLA_FFI_Error_Create(&args);
}

static int name_is(const XLA_FFI_ByteSpan* span, const char* name) {
  size_t n = strlen(name);
  return span->len == n && memcmp(span->ptr, name, n) == 0;
}

static void* attr(const XLA_FFI_Attrs* attrs, const char* name, XLA_FFI_AttrType type) {
  for (int64_t i = 0; i < attrs->size; i++) {
    if (attrs->types[i] == type && name_is(attrs->names[i], name)) return attrs->attrs[i];
  }
  return NULL;
}

static int int_attr(const XLA_FFI_Attrs* attrs, const char* name, int64_t* out) {
  XLA_FFI_Scalar* s = (XLA_FFI_Scalar*)attr(attrs, name, XLA_FFI_AttrType_SCALAR);
  if (s == NULL || s->dtype != XLA_FFI_DataType_S64) return 0;
  memcpy(out, s->value, sizeof(*out));
  return 1;
}

static int float_attr(const XLA_FFI_Attrs* attrs, const char* name, double* out) {
  XLA_FFI_Scalar* s = (XLA_FFI_Scalar*)attr(attrs, name, XLA_FFI_AttrType_SCALAR);
  if (s == NULL || s->dtype != XLA_FFI_DataType_F64) return 0;
  memcpy(out, s->value, sizeof(*out));
  return 1;
}

static const int64_t* array_attr(const XLA_FFI_Attrs* attrs, const char* name, size_t* n) {
  XLA_FFI_Array* a = (XLA_FFI_Array*)attr(attrs, name, XLA_FFI_AttrType_ARRAY);
  if (a == NULL || a->dtype != XLA_FFI_DataType_S64) return NULL;
  *n = a->size;
  return (const int64_t*)a->data;
}

static size_t elements(const XLA_FFI_Buffer* b) {
  size_t n = 1;
  for (int64_t d = 0; d < b->rank; d++) n *= (size_t)b->dims[d];
  return n;
}

/* The first operand or result that is not the ordering token. */
static XLA_FFI_Buffer* data_buffer(int64_t size, void** items) {
  for (int64_t i = 0; i < size; i++) {
    XLA_FFI_Buffer* b = (XLA_FFI_Buffer*)items[i];
    if (b->dtype != XLA_FFI_DataType_TOKEN) return b;
  }
  return NULL;
}

/* XLA mallocs each result. shmcomm.jax raises glibc's thresholds so that results up to SHMCOMM_JAX_HEAP_BYTES stay
 * mapped between calls (shmcomm/jax/results_heap.py); a larger one, or any with that setting at 0, is mapped afresh
 * on every call and unmapped when freed, and the collective's writes then fault it in page by page: 16384 faults for
 * 64 MiB of 4 KiB pages, which cost more than the collective itself. Where transparent huge pages are granted on
 * request (the kernel's usual "madvise" mode, as numpy requests them for its large arrays), asking for them on the
 * result's whole huge pages makes that 32 faults at 2 MiB. The size is the kernel's (ctx->huge_page, read by Python
 * from /sys/kernel/mm/transparent_hugepage/hpage_pmd_size; 0 where there are none). Only a hint: the kernel may ignore
 * it, and the memory is XLA's either way. */
static void want_huge_pages(const smc_jax_context_t* ctx, void* dst, size_t bytes) {
  uintptr_t page = (uintptr_t)ctx->huge_page;
  if (page == 0 || (page & (page - 1)) != 0 || bytes < 2 * page) return;
  uintptr_t start = ((uintptr_t)dst + page - 1) & ~(page - 1);
  uintptr_t end = ((uintptr_t)dst + bytes) & ~(page - 1);
#ifdef MADV_HUGEPAGE
  if (end > start) (void)madvise((void*)start, end - start, MADV_HUGEPAGE);
#else
  (void)start;
  (void)end;
#endif
}

/* The core's collective, on this host's segment. */
static smc_result_t run_direct(const smc_jax_context_t* ctx, const smc_jax_call_t* call, int c_op, int64_t divisor,
                               size_t esize) {
  const smc_jax_core_t* core = &ctx->core;
  size_t n = call->nranks;
  uint64_t send_bytes[n > 0 ? n : 1], recv_bytes[n > 0 ? n : 1];
  size_t row_elems = 1;
  for (int64_t d = 1; d < call->src_ndim; d++) row_elems *= (size_t)call->src_dims[d];
  switch (call->kind) {
    case SMC_COLL_ALLREDUCE:
      return core->allreduce(ctx->comm, call->src, call->dst, call->src_bytes / esize, call->dtype, c_op,
                             call->prescale, call->postscale, divisor, call->tag);
    case SMC_COLL_REDUCESCATTER:
      for (size_t r = 0; r < n; r++) recv_bytes[r] = (uint64_t)call->rows[r] * row_elems;  /* elements */
      return core->reducescatter(ctx->comm, call->src, call->dst, recv_bytes, call->dtype, c_op, call->prescale,
                                 call->postscale, divisor, call->tag);
    case SMC_COLL_BROADCAST:
      return core->broadcast(ctx->comm, call->src, call->dst, call->src_bytes, call->root, call->tag);
    case SMC_COLL_ALLGATHERV:
      for (size_t r = 0; r < n; r++) recv_bytes[r] = (uint64_t)call->rows[r] * row_elems * esize;
      return core->allgatherv(ctx->comm, call->src, call->src_bytes, call->dst, recv_bytes, call->tag);
    case SMC_COLL_ALLTOALLV:
      for (size_t r = 0; r < n; r++) {
        send_bytes[r] = (uint64_t)call->sends[r] * row_elems * esize;
        recv_bytes[r] = (uint64_t)call->rows[r] * row_elems * esize;
      }
      return core->alltoallv(ctx->comm, call->src, send_bytes, call->dst, recv_bytes, call->tag);
    case SMC_COLL_BARRIER:
      return core->barrier(ctx->comm);
    default:
      return SMC_ERR_INVALID;
  }
}

static XLA_FFI_Error* collective(XLA_FFI_CallFrame* frame) {
  /* XLA first asks which version of the API the handler speaks. */
  if (frame->extension_start != NULL && frame->extension_start->type == XLA_FFI_Extension_Metadata) {
    XLA_FFI_Metadata_Extension* ext = (XLA_FFI_Metadata_Extension*)frame->extension_start;
    ext->metadata->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
    ext->metadata->api_version.extension_start = NULL;
    ext->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
    ext->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
    ext->metadata->traits = 0;
    return NULL;
  }
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;

  const XLA_FFI_Attrs* attrs = &frame->attrs;
  int64_t ctx_addr, pid, kind, dtype, op, c_op, divisor, root, tag;
  double prescale, postscale;
  if (!int_attr(attrs, "context", &ctx_addr) || !int_attr(attrs, "pid", &pid) || !int_attr(attrs, "kind", &kind) ||
      !int_attr(attrs, "dtype", &dtype) || !int_attr(attrs, "op", &op) || !int_attr(attrs, "c_op", &c_op) ||
      !int_attr(attrs, "divisor", &divisor) || !int_attr(attrs, "root", &root) || !int_attr(attrs, "tag", &tag) ||
      !float_attr(attrs, "prescale", &prescale) || !float_attr(attrs, "postscale", &postscale)) {
    return fail(frame, XLA_FFI_Error_Code_INVALID_ARGUMENT, "shmcomm.jax: a collective without its attributes");
  }
  /* Checked before the context is read: an executable compiled by another process (a persistent compilation
   * cache) carries that process's address. */
  if (pid != (int64_t)getpid()) {
    return fail(frame, XLA_FFI_Error_Code_FAILED_PRECONDITION,
                "shmcomm.jax: this executable was compiled by another process; disable JAX's persistent "
                "compilation cache for functions that call shmcomm collectives");
  }
  smc_jax_context_t* ctx = (smc_jax_context_t*)(intptr_t)ctx_addr;

  smc_jax_call_t call;
  memset(&call, 0, offsetof(smc_jax_call_t, error));
  call.error[0] = '\0';
  call.kind = (int)kind;
  call.dtype = (int)dtype;
  call.op = (int)op;
  call.root = (int)root;
  call.prescale = prescale;
  call.postscale = postscale;
  call.tag = (uint64_t)tag;
  size_t nrows = 0, nsends = 0;
  call.rows = array_attr(attrs, "rows", &nrows);
  call.sends = array_attr(attrs, "sends", &nsends);
  call.nranks = nrows;
  if ((call.sends != NULL && nsends != nrows) || nrows > (size_t)ctx->max_ranks) {
    return fail(frame, XLA_FFI_Error_Code_INVALID_ARGUMENT, "shmcomm.jax: per-rank counts of the wrong length");
  }
  XLA_FFI_ByteSpan* name = (XLA_FFI_ByteSpan*)attr(attrs, "name", XLA_FFI_AttrType_STRING);
  call.name = name != NULL ? name->ptr : "collective";
  call.name_len = name != NULL ? name->len : strlen("collective");

  XLA_FFI_Buffer* src = data_buffer(frame->args.size, frame->args.args);
  XLA_FFI_Buffer* dst = data_buffer(frame->rets.size, frame->rets.rets);
  size_t esize = 1;
  if (kind != SMC_COLL_BARRIER) {
    if (src == NULL || dst == NULL) {
      return fail(frame, XLA_FFI_Error_Code_INVALID_ARGUMENT, "shmcomm.jax: a collective without its array");
    }
    size_t count = elements(src);
    size_t dst_count = elements(dst);
    call.src = src->data;
    call.src_dims = src->dims;
    call.src_ndim = src->rank;
    call.dst = dst->data;
    /* The element size from the dtype the primitive wrote; the byte-moving collectives also carry types the core
     * does not reduce (dtype -1): their element size is the attribute `itemsize`. */
    int64_t itemsize = 0;
    if (!int_attr(attrs, "itemsize", &itemsize) || itemsize <= 0) {
      return fail(frame, XLA_FFI_Error_Code_INVALID_ARGUMENT, "shmcomm.jax: a collective without its item size");
    }
    esize = (size_t)itemsize;
    call.src_bytes = count * esize;
    call.dst_bytes = dst_count * esize;
    want_huge_pages(ctx, call.dst, call.dst_bytes);
  }

  if (ctx->comm == NULL) {  /* across hosts, with the engine running, or after shutdown: Python decides */
    if (smc_jax_python(ctx, &call) != 0) return fail(frame, XLA_FFI_Error_Code_INTERNAL, call.error);
    return NULL;
  }
  smc_result_t rc = run_direct(ctx, &call, (int)c_op, divisor, esize);
  if (rc == SMC_SUCCESS) return NULL;
  call.rc = rc;
  /* The core's failure data is this thread's: Python reads it in this thread, in the callback. */
  if (smc_jax_python(ctx, &call) != 0 && call.error[0] != '\0') {
    return fail(frame, XLA_FFI_Error_Code_INTERNAL, call.error);
  }
  snprintf(call.error, sizeof(call.error), "%s", ctx->core.last_error());
  return fail(frame, XLA_FFI_Error_Code_INTERNAL, call.error);
}

void* shmcomm_jax_handler_address(void) { return (void*)&collective; }
