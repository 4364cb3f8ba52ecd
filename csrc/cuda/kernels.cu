// SPDX-License-Identifier: Apache-2.0
// Element-wise kernels for CUDA tensors (shmcomm/transport/cuda_kernels.py compiles this with nvcc on first use):
// - smc_cuda_scale: x = factor * x in place, 16-bit floats computed in float32 and rounded once (the pre- and
//   post-scaling of allreduce and reducescatter, and the average's division);
// - smc_cuda_copy_batch: many (src, dst, bytes) copies in one launch (packing tensors into a fusion buffer and
//   unpacking them), instead of one copy kernel per tensor.
// Every function enqueues on the given stream, returns at once, and returns the cudaError_t of the launch. Nothing
// here synchronizes the device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

// The dtype codes of shmcomm's C core (csrc/include/shmcomm.h, smc_datatype_t) for the floating types.
enum { SMC_CUDA_FLOAT16 = 0, SMC_CUDA_BFLOAT16 = 1, SMC_CUDA_FLOAT32 = 2, SMC_CUDA_FLOAT64 = 3 };
enum { SMC_CUDA_BATCH = 64 };  // copies per launch: the arrays travel by value as kernel parameters (< 4 KiB)
static const int THREADS = 256;
static const unsigned MAX_BLOCKS = 4096;  // grid-stride loops cover the rest

__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ double widen(double v) { return v; }

template <typename T> __device__ __forceinline__ T narrow(float v);
template <> __device__ __forceinline__ __half narrow<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float narrow<float>(float v) { return v; }
template <typename T> __device__ __forceinline__ T narrow_double(double v) { return narrow<T>((float)v); }
template <> __device__ __forceinline__ double narrow_double<double>(double v) { return v; }

template <typename T>
__global__ void scale_kernel(T* x, size_t n, double factor) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    x[i] = narrow_double<T>((double)widen(x[i]) * factor);
  }
}

template <>
__global__ void scale_kernel<__half>(__half* x, size_t n, double factor) {
  const float f = (float)factor;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    x[i] = narrow<__half>(widen(x[i]) * f);
  }
}

template <>
__global__ void scale_kernel<__nv_bfloat16>(__nv_bfloat16* x, size_t n, double factor) {
  const float f = (float)factor;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    x[i] = narrow<__nv_bfloat16>(widen(x[i]) * f);
  }
}

struct copy_batch {
  const unsigned char* src[SMC_CUDA_BATCH];
  unsigned char* dst[SMC_CUDA_BATCH];
  size_t bytes[SMC_CUDA_BATCH];
};

// blockIdx.y picks the copy; the blocks along x stride over its bytes, 16 at a time where both ends are aligned (the
// last bytes of a size that is no multiple of 16 one at a time).
__global__ void copy_batch_kernel(copy_batch batch) {
  const unsigned char* src = batch.src[blockIdx.y];
  unsigned char* dst = batch.dst[blockIdx.y];
  const size_t bytes = batch.bytes[blockIdx.y];
  const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
  if ((((uintptr_t)src | (uintptr_t)dst) & 15) == 0) {
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    for (size_t i = start; i < bytes / 16; i += stride) d[i] = s[i];
    const size_t tail = bytes & ~(size_t)15;
    if (start < bytes - tail) dst[tail + start] = src[tail + start];
  } else {
    for (size_t i = start; i < bytes; i += stride) dst[i] = src[i];
  }
}

__global__ void empty_kernel(void) {}

static unsigned blocks_for(size_t n) {
  size_t blocks = (n + THREADS - 1) / THREADS;
  if (blocks == 0) blocks = 1;
  return blocks > MAX_BLOCKS ? MAX_BLOCKS : (unsigned)blocks;
}

template <typename T>
static int launch_scale(void* x, size_t n, double factor, cudaStream_t stream) {
  scale_kernel<T><<<blocks_for(n), THREADS, 0, stream>>>((T*)x, n, factor);
  return (int)cudaGetLastError();
}

extern "C" {

// The interface version shmcomm/transport/cuda_kernels.py expects.
int smc_cuda_abi_version(void) { return 3; }

// One empty launch, waited for: a driver that cannot run these kernels (none, or older than the toolkit) answers here,
// when the library loads, instead of at every collective.
int smc_cuda_probe(void) {
  empty_kernel<<<1, 1>>>();
  cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) error = cudaStreamSynchronize(0);
  return (int)error;
}

int smc_cuda_scale(void* x, size_t n, int dtype, double factor, void* stream) {
  if (n == 0) return 0;
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case SMC_CUDA_FLOAT16: return launch_scale<__half>(x, n, factor, s);
    case SMC_CUDA_BFLOAT16: return launch_scale<__nv_bfloat16>(x, n, factor, s);
    case SMC_CUDA_FLOAT32: return launch_scale<float>(x, n, factor, s);
    case SMC_CUDA_FLOAT64: return launch_scale<double>(x, n, factor, s);
    default: return (int)cudaErrorInvalidValue;
  }
}

int smc_cuda_copy_batch(const void* const* srcs, void* const* dsts, const size_t* bytes, int n, void* stream) {
  for (int first = 0; first < n; first += SMC_CUDA_BATCH) {
    copy_batch batch;
    const int count = n - first < SMC_CUDA_BATCH ? n - first : SMC_CUDA_BATCH;
    size_t largest = 0;
    for (int i = 0; i < count; i++) {
      batch.src[i] = (const unsigned char*)srcs[first + i];
      batch.dst[i] = (unsigned char*)dsts[first + i];
      batch.bytes[i] = bytes[first + i];
      if (bytes[first + i] > largest) largest = bytes[first + i];
    }
    if (largest == 0) continue;
    dim3 grid(blocks_for(largest / 16 + 1), count);
    copy_batch_kernel<<<grid, THREADS, 0, (cudaStream_t)stream>>>(batch);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return (int)error;
  }
  return 0;
}

}  // extern "C"
