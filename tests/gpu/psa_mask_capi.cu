// C ABI over the launchers of ops/psa_mask_kernel.h, so that run_gpu_checks.py can
// check and time the op's very kernels through ctypes on a machine without Paddle,
// and the two baselines of psa_mask_baselines.cuh beside them.
//
// dtype: 0 float32, 1 float64, 2 float16 (__half); direction: 0 forward
// (x -> Y), 1 backward (grad_Y -> grad_x); psa_type: 0 collect, 1 distribute;
// kernels: 0 the op's, 1 landed, 2 per position (psa_mask_baselines.cuh).
// Every function returns 0, 1 (bad argument) or 2 (CUDA error); then
// psa_capi_last_error() says which call failed and why (per thread).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>

#include "../../ops/psa_mask_kernel.h"
#include "psa_mask_baselines.cuh"

namespace {

constexpr int kInvalidArgument = 1;
constexpr int kCudaError = 2;

thread_local char last_error[1024] = "";

int fail(int code, const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vsnprintf(last_error, sizeof(last_error), format, args);
  va_end(args);
  return code;
}

#define PSA_CUDA_CHECK(call)                                                           \
  do {                                                                                 \
    const cudaError_t psa_status_ = (call);                                            \
    if (psa_status_ != cudaSuccess) {                                                  \
      return fail(kCudaError, "%s failed: %s (%s) [psa_mask_capi.cu:%d]", #call,      \
                  cudaGetErrorName(psa_status_), cudaGetErrorString(psa_status_),      \
                  __LINE__);                                                           \
    }                                                                                  \
  } while (0)

#define PSA_RETURN_IF_ERROR(expr)          \
  do {                                     \
    const int psa_code_ = (expr);          \
    if (psa_code_ != 0) return psa_code_;  \
  } while (0)

int64_t dtype_size(int dtype) { return dtype == 0 ? 4 : dtype == 1 ? 8 : dtype == 2 ? 2 : 0; }

// Freed on every return path, the error ones included.
struct DeviceBuffer {
  void* ptr = nullptr;
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
};

// Allocates `bytes` (none for 0: nothing reads it), then copies `host` in or, without
// one, fills them with fill_byte (-1: leaves them as allocated).
int allocate(DeviceBuffer* buffer, int64_t bytes, int fill_byte, const void* host = nullptr) {
  if (bytes == 0) return 0;
  const size_t size = static_cast<size_t>(bytes);
  PSA_CUDA_CHECK(cudaMalloc(&buffer->ptr, size));
  if (host != nullptr) PSA_CUDA_CHECK(cudaMemcpy(buffer->ptr, host, size, cudaMemcpyHostToDevice));
  if (host == nullptr && fill_byte >= 0) PSA_CUDA_CHECK(cudaMemset(buffer->ptr, fill_byte, size));
  return 0;
}

// One launch's arguments, checked.
struct Call {
  int dtype, direction, psa_type, kernels;
  int64_t max_grid_x;  // of the op's kernels
  psa_mask::Geometry g;
  int64_t input_bytes() const {
    return (direction == 0 ? g.x_numel() : g.y_numel()) * dtype_size(dtype);
  }
  int64_t output_bytes() const {
    return (direction == 0 ? g.y_numel() : g.x_numel()) * dtype_size(dtype);
  }
};

int make_call(Call* call, int kernels, int64_t max_grid_x, int dtype, int direction,
              int psa_type, int64_t num, int64_t feature_h, int64_t feature_w, int64_t mask_h,
              int64_t mask_w) {
  if (kernels < 0 || kernels > 2) {
    return fail(kInvalidArgument,
                "kernels must be 0 (the op's), 1 (landed) or 2 (per position), got %d", kernels);
  }
  if (max_grid_x < 1 || max_grid_x > psa_mask::kMaxGridX) {
    return fail(kInvalidArgument, "max_grid_x must be in [1, 2^31 - 1], got %lld",
                static_cast<long long>(max_grid_x));
  }
  if (dtype_size(dtype) == 0) {
    return fail(kInvalidArgument,
                "dtype must be 0 (float32), 1 (float64) or 2 (float16), got %d", dtype);
  }
  if (direction != 0 && direction != 1) {
    return fail(kInvalidArgument,
                "direction must be 0 (forward) or 1 (backward), got %d", direction);
  }
  if (psa_type != psa_mask::kCollect && psa_type != psa_mask::kDistribute) {
    return fail(kInvalidArgument,
                "psa_type must be 0 (collect) or 1 (distribute), got %d", psa_type);
  }
  if (num < 0 || feature_h < 0 || feature_w < 0 || mask_h < 1 || mask_w < 1) {
    return fail(kInvalidArgument,
                "mask_h and mask_w must be >= 1 and num, feature_h, feature_w >= 0, "
                "got mask %lldx%lld, %lld, %lld, %lld", static_cast<long long>(mask_h),
                static_cast<long long>(mask_w), static_cast<long long>(num),
                static_cast<long long>(feature_h), static_cast<long long>(feature_w));
  }
  // The kernels index with int64_t: refuse sizes whose byte counts overflow it.
  const double positions = static_cast<double>(feature_h) * feature_w;
  if (8.0 * num * positions * (positions + static_cast<double>(mask_h) * mask_w) > 9.0e18) {
    return fail(kInvalidArgument, "shape too large for 64-bit indexing");
  }
  *call = Call{dtype, direction, psa_type, kernels, max_grid_x,
               psa_mask::make_geometry(num, feature_h, feature_w, mask_h, mask_w)};
  // A non-sticky error an earlier call left behind is not ours to report.
  cudaGetLastError();
  return 0;
}

template <typename T>
cudaError_t launch_typed(const Call& c, const void* input, void* output) {
  const T* in = static_cast<const T*>(input);
  T* out = static_cast<T*>(output);
  if (c.kernels != 0) {
    return psa_mask_baselines::launch<T>(c.kernels, c.direction, in, out, c.g, c.psa_type,
                                         nullptr);
  }
  if (c.max_grid_x == psa_mask::kMaxGridX) {  // the op's own entry points
    return c.direction == 0
               ? psa_mask::launch_psa_mask_forward<T>(in, out, c.g, c.psa_type, nullptr)
               : psa_mask::launch_psa_mask_backward<T>(in, out, c.g, c.psa_type, nullptr);
  }
  return psa_mask::launch_psa_mask<T>(c.direction, in, out, c.g, c.psa_type, nullptr,
                                      c.max_grid_x);
}

int launch(const Call& c, const void* input, void* output) {
  PSA_CUDA_CHECK(c.dtype == 0   ? launch_typed<float>(c, input, output)
                 : c.dtype == 1 ? launch_typed<double>(c, input, output)
                                : launch_typed<__half>(c, input, output));
  return 0;
}

struct Event {
  cudaEvent_t event = nullptr;
  ~Event() {
    if (event != nullptr) cudaEventDestroy(event);
  }
};

// Milliseconds per call of run() over `repeats` calls after `warmup` ones, by CUDA events.
template <typename Run>
int time_calls(int warmup, int repeats, double* ms_per_call, const Run& run) {
  if (warmup < 0 || repeats < 1 || ms_per_call == nullptr) {
    return fail(kInvalidArgument, "need warmup >= 0, repeats >= 1 and an output pointer");
  }
  for (int i = 0; i < warmup; ++i) PSA_RETURN_IF_ERROR(run());
  PSA_CUDA_CHECK(cudaDeviceSynchronize());
  Event start, stop;
  PSA_CUDA_CHECK(cudaEventCreate(&start.event));
  PSA_CUDA_CHECK(cudaEventCreate(&stop.event));
  PSA_CUDA_CHECK(cudaEventRecord(start.event, nullptr));
  for (int i = 0; i < repeats; ++i) PSA_RETURN_IF_ERROR(run());
  PSA_CUDA_CHECK(cudaEventRecord(stop.event, nullptr));
  PSA_CUDA_CHECK(cudaEventSynchronize(stop.event));
  float elapsed_ms = 0.0f;
  PSA_CUDA_CHECK(cudaEventElapsedTime(&elapsed_ms, start.event, stop.event));
  *ms_per_call = static_cast<double>(elapsed_ms) / repeats;
  return 0;
}

}  // namespace

extern "C" {

// Bumped when a signature changes; run_gpu_checks.py refuses a mismatch.
int psa_capi_abi_version(void) { return 3; }

const char* psa_capi_last_error(void) { return last_error; }

int psa_capi_dtype_size(int dtype) { return static_cast<int>(dtype_size(dtype)); }

// The current device's name, compute capability and memory, and the runtime and
// driver versions (13000 for CUDA 13.0); a CUDA error where there is no device.
int psa_capi_device_info(char* name, int name_length, int* major, int* minor,
                         long long* total_bytes, int* runtime_version, int* driver_version) {
  int count = 0, device = 0;
  PSA_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (count < 1) return fail(kCudaError, "cudaGetDeviceCount found no CUDA device");
  PSA_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop;
  PSA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::snprintf(name, static_cast<size_t>(name_length), "%s", prop.name);
  *major = prop.major;
  *minor = prop.minor;
  *total_bytes = static_cast<long long>(prop.totalGlobalMem);
  PSA_CUDA_CHECK(cudaRuntimeGetVersion(runtime_version));
  PSA_CUDA_CHECK(cudaDriverGetVersion(driver_version));
  return 0;
}

// Host pointers, contiguous: forward x [num, mask_h*mask_w, H, W] -> y [num, H*W, H, W],
// backward grad_y -> grad_x. Allocates, copies the input in, fills the output's
// device buffer with fill_byte (0xFF is NaN in every dtype), launches, synchronizes
// (so a fault of the kernel itself is seen), copies the output back and frees.
// max_grid_x: the widest first grid dimension the op's kernels may use (2^31 - 1:
// as the op launches them; less runs the grid's second dimension).
int psa_capi_run(int kernels, int64_t max_grid_x, int dtype, int direction, int psa_type,
                 int64_t num, int64_t feature_h, int64_t feature_w, int64_t mask_h,
                 int64_t mask_w, const void* input, void* output, int fill_byte) {
  Call c{};
  PSA_RETURN_IF_ERROR(make_call(&c, kernels, max_grid_x, dtype, direction, psa_type, num,
                                feature_h, feature_w, mask_h, mask_w));
  DeviceBuffer device_input, device_output;
  PSA_RETURN_IF_ERROR(allocate(&device_input, c.input_bytes(), -1, input));
  PSA_RETURN_IF_ERROR(allocate(&device_output, c.output_bytes(), fill_byte));
  PSA_RETURN_IF_ERROR(launch(c, device_input.ptr, device_output.ptr));
  PSA_CUDA_CHECK(cudaDeviceSynchronize());
  if (c.output_bytes() > 0) {
    PSA_CUDA_CHECK(cudaMemcpy(output, device_output.ptr, static_cast<size_t>(c.output_bytes()),
                              cudaMemcpyDeviceToHost));
  }
  return 0;
}

// Milliseconds per launch of `kernels` on buffers of its own (input zeroed).
int psa_capi_time(int kernels, int dtype, int direction, int psa_type, int64_t num,
                  int64_t feature_h, int64_t feature_w, int64_t mask_h, int64_t mask_w,
                  int warmup, int repeats, double* ms_per_call) {
  Call c{};
  PSA_RETURN_IF_ERROR(make_call(&c, kernels, psa_mask::kMaxGridX, dtype, direction, psa_type,
                                num, feature_h, feature_w, mask_h, mask_w));
  DeviceBuffer input, output;
  PSA_RETURN_IF_ERROR(allocate(&input, c.input_bytes(), 0));
  PSA_RETURN_IF_ERROR(allocate(&output, c.output_bytes(), -1));
  return time_calls(warmup, repeats, ms_per_call,
                    [&] { return launch(c, input.ptr, output.ptr); });
}

// The bandwidth reference: a device-to-device cudaMemcpy of `bytes` (read once, written once).
int psa_capi_time_copy(int64_t bytes, int warmup, int repeats, double* ms_per_call) {
  if (bytes < 1) {
    return fail(kInvalidArgument, "bytes must be >= 1, got %lld", static_cast<long long>(bytes));
  }
  cudaGetLastError();
  DeviceBuffer source, target;
  PSA_RETURN_IF_ERROR(allocate(&source, bytes, 0));
  PSA_RETURN_IF_ERROR(allocate(&target, bytes, -1));
  return time_calls(warmup, repeats, ms_per_call, [&] {
    PSA_CUDA_CHECK(cudaMemcpyAsync(target.ptr, source.ptr, static_cast<size_t>(bytes),
                                   cudaMemcpyDeviceToDevice, nullptr));
    return 0;
  });
}

}  // extern "C"
