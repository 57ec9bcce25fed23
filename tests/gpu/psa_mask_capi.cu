// C ABI over the PSA mask CUDA kernels of ops/psa_mask_kernel.h, so the
// kernels can be checked and timed on a GPU machine without Paddle: ctypes
// calls it from numpy (host-pointer functions) or CuPy (device-pointer ones).
// run_gpu_checks.py builds and drives it.
//
// dtype codes: 0 float32, 1 float64, 2 float16 (__half).
// Every function returns 0 on success, 1 for a bad argument, 2 for a CUDA
// error; psa_capi_last_error() then says what failed (per thread).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>

#include "../../ops/psa_mask_kernel.h"

namespace {

constexpr int kOk = 0;
constexpr int kInvalidArgument = 1;
constexpr int kCudaError = 2;

constexpr int kFloat32 = 0;
constexpr int kFloat64 = 1;
constexpr int kFloat16 = 2;

thread_local char last_error[1024] = "";

int fail(int code, const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vsnprintf(last_error, sizeof(last_error), format, args);
  va_end(args);
  return code;
}

int cuda_fail(cudaError_t status, const char* call, int line) {
  return fail(kCudaError, "%s failed: %s (%s) [psa_mask_capi.cu:%d]", call,
              cudaGetErrorName(status), cudaGetErrorString(status), line);
}

#define PSA_CUDA_CHECK(call)                                          \
  do {                                                                \
    const cudaError_t psa_status_ = (call);                           \
    if (psa_status_ != cudaSuccess) {                                 \
      return cuda_fail(psa_status_, #call, __LINE__);                 \
    }                                                                 \
  } while (0)

#define PSA_RETURN_IF_ERROR(expr)             \
  do {                                        \
    const int psa_code_ = (expr);             \
    if (psa_code_ != kOk) return psa_code_;   \
  } while (0)

// Frees on every return path, including the error ones.
struct DeviceBuffer {
  void* ptr = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
};

struct Event {
  cudaEvent_t event = nullptr;
  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    if (event != nullptr) cudaEventDestroy(event);
  }
};

int allocate(DeviceBuffer* buffer, int64_t bytes, const char* name) {
  // cudaMalloc(0) may hand back null or not: keep null, nothing reads it.
  if (bytes == 0) return kOk;
  const cudaError_t status = cudaMalloc(&buffer->ptr, static_cast<size_t>(bytes));
  if (status != cudaSuccess) {
    return fail(kCudaError, "cudaMalloc of %s (%lld bytes) failed: %s (%s)", name,
                static_cast<long long>(bytes), cudaGetErrorName(status),
                cudaGetErrorString(status));
  }
  return kOk;
}

int64_t dtype_size(int dtype) {
  switch (dtype) {
    case kFloat32: return 4;
    case kFloat64: return 8;
    case kFloat16: return 2;
    default: return 0;
  }
}

int check_arguments(int dtype, int psa_type, int64_t num, int64_t feature_h,
                    int64_t feature_w, int64_t mask_h, int64_t mask_w) {
  if (dtype_size(dtype) == 0) {
    return fail(kInvalidArgument,
                "dtype must be 0 (float32), 1 (float64) or 2 (float16), got %d", dtype);
  }
  if (psa_type != psa_mask::kCollect && psa_type != psa_mask::kDistribute) {
    return fail(kInvalidArgument,
                "psa_type must be 0 (collect) or 1 (distribute), got %d", psa_type);
  }
  if (num < 0 || feature_h < 0 || feature_w < 0) {
    return fail(kInvalidArgument, "num, feature_h, feature_w must be >= 0, got %lld, %lld, %lld",
                static_cast<long long>(num), static_cast<long long>(feature_h),
                static_cast<long long>(feature_w));
  }
  if (mask_h < 1 || mask_w < 1) {
    return fail(kInvalidArgument, "mask_h and mask_w must be >= 1, got %lldx%lld",
                static_cast<long long>(mask_h), static_cast<long long>(mask_w));
  }
  // The kernels index with int64_t: refuse sizes whose byte counts overflow it.
  const double positions = static_cast<double>(feature_h) * static_cast<double>(feature_w);
  const double y_bytes = static_cast<double>(num) * positions * positions * 8.0;
  const double x_bytes =
      static_cast<double>(num) * static_cast<double>(mask_h) * static_cast<double>(mask_w) *
      positions * 8.0;
  if (y_bytes > 9.0e18 || x_bytes > 9.0e18) {
    return fail(kInvalidArgument, "shape too large for 64-bit indexing");
  }
  return kOk;
}

// Calls fn(T{}) with the element type of dtype; dtype was checked before.
template <typename Fn>
int dispatch(int dtype, Fn&& fn) {
  switch (dtype) {
    case kFloat32: return fn(float{});
    case kFloat64: return fn(double{});
    default: return fn(__half{});
  }
}

psa_mask::Geometry geometry(int64_t num, int64_t feature_h, int64_t feature_w,
                            int64_t mask_h, int64_t mask_w) {
  return psa_mask::make_geometry(num, feature_h, feature_w, mask_h, mask_w);
}

int launch_forward(int dtype, const void* x, void* y, const psa_mask::Geometry& g,
                   int psa_type, cudaStream_t stream) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    PSA_CUDA_CHECK(psa_mask::launch_psa_mask_forward<T>(
        static_cast<const T*>(x), static_cast<T*>(y), g, psa_type, stream));
    return kOk;
  });
}

int launch_backward(int dtype, const void* grad_y, void* grad_x,
                    const psa_mask::Geometry& g, int psa_type, cudaStream_t stream) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    PSA_CUDA_CHECK(psa_mask::launch_psa_mask_backward<T>(
        static_cast<const T*>(grad_y), static_cast<T*>(grad_x), g, psa_type, stream));
    return kOk;
  });
}

// Shared body of the two host-pointer functions: copy `input` in, fill the
// output with fill_byte (-1: leave what cudaMalloc gave), launch, copy back.
template <typename Launch>
int run_on_host_buffers(const void* input, int64_t input_bytes, void* output,
                        int64_t output_bytes, int fill_byte, const Launch& launch) {
  if (fill_byte < -1 || fill_byte > 255) {
    return fail(kInvalidArgument, "fill_byte must be -1 (no fill) or 0..255, got %d",
                fill_byte);
  }
  if ((input_bytes > 0 && input == nullptr) || (output_bytes > 0 && output == nullptr)) {
    return fail(kInvalidArgument, "null host pointer");
  }
  DeviceBuffer device_input, device_output;
  PSA_RETURN_IF_ERROR(allocate(&device_input, input_bytes, "the input"));
  PSA_RETURN_IF_ERROR(allocate(&device_output, output_bytes, "the output"));
  if (input_bytes > 0) {
    PSA_CUDA_CHECK(cudaMemcpy(device_input.ptr, input, static_cast<size_t>(input_bytes),
                              cudaMemcpyHostToDevice));
  }
  if (output_bytes > 0 && fill_byte >= 0) {
    PSA_CUDA_CHECK(cudaMemset(device_output.ptr, fill_byte, static_cast<size_t>(output_bytes)));
  }
  PSA_RETURN_IF_ERROR(launch(device_input.ptr, device_output.ptr));
  // Surfaces errors of the kernel itself (an illegal address, say), not only of the launch.
  PSA_CUDA_CHECK(cudaDeviceSynchronize());
  if (output_bytes > 0) {
    PSA_CUDA_CHECK(cudaMemcpy(output, device_output.ptr, static_cast<size_t>(output_bytes),
                              cudaMemcpyDeviceToHost));
  }
  return kOk;
}

// Milliseconds per call of launch() over `repeats` calls after `warmup` ones.
template <typename Launch>
int time_calls(int warmup, int repeats, double* ms_per_call, const Launch& launch) {
  if (warmup < 0 || repeats < 1 || ms_per_call == nullptr) {
    return fail(kInvalidArgument, "need warmup >= 0, repeats >= 1 and an output pointer");
  }
  for (int i = 0; i < warmup; ++i) PSA_RETURN_IF_ERROR(launch());
  PSA_CUDA_CHECK(cudaDeviceSynchronize());
  Event start, stop;
  PSA_CUDA_CHECK(cudaEventCreate(&start.event));
  PSA_CUDA_CHECK(cudaEventCreate(&stop.event));
  PSA_CUDA_CHECK(cudaEventRecord(start.event, 0));
  for (int i = 0; i < repeats; ++i) PSA_RETURN_IF_ERROR(launch());
  PSA_CUDA_CHECK(cudaEventRecord(stop.event, 0));
  PSA_CUDA_CHECK(cudaEventSynchronize(stop.event));
  float elapsed_ms = 0.0f;
  PSA_CUDA_CHECK(cudaEventElapsedTime(&elapsed_ms, start.event, stop.event));
  *ms_per_call = static_cast<double>(elapsed_ms) / repeats;
  return kOk;
}

// Clears a non-sticky error a previous call may have left, so it is not
// reported as ours.
void clear_stale_error() { cudaGetLastError(); }

}  // namespace

extern "C" {

// Bumped when a signature changes; run_gpu_checks.py refuses a mismatch.
int psa_capi_abi_version(void) { return 1; }

const char* psa_capi_last_error(void) { return last_error; }

int psa_capi_dtype_size(int dtype) { return static_cast<int>(dtype_size(dtype)); }

int psa_capi_device_count(int* count) {
  if (count == nullptr) return fail(kInvalidArgument, "null count pointer");
  *count = 0;
  PSA_CUDA_CHECK(cudaGetDeviceCount(count));
  return kOk;
}

// Name, compute capability and memory of the current device, and the
// runtime and driver versions (e.g. 13000 for CUDA 13.0).
int psa_capi_device_info(char* name, int name_length, int* major, int* minor,
                         long long* total_bytes, int* runtime_version,
                         int* driver_version) {
  if (name == nullptr || name_length < 1 || major == nullptr || minor == nullptr ||
      total_bytes == nullptr || runtime_version == nullptr || driver_version == nullptr) {
    return fail(kInvalidArgument, "null output pointer");
  }
  int device = 0;
  PSA_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop;
  PSA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::snprintf(name, static_cast<size_t>(name_length), "%s", prop.name);
  *major = prop.major;
  *minor = prop.minor;
  *total_bytes = static_cast<long long>(prop.totalGlobalMem);
  PSA_CUDA_CHECK(cudaRuntimeGetVersion(runtime_version));
  PSA_CUDA_CHECK(cudaDriverGetVersion(driver_version));
  return kOk;
}

int psa_capi_synchronize(void) {
  PSA_CUDA_CHECK(cudaDeviceSynchronize());
  return kOk;
}

// Device pointers (CuPy): x [num, mask_h*mask_w, H, W] -> y [num, H*W, H, W],
// contiguous, on `stream` (null: the legacy default stream). Returns after the
// launch; call psa_capi_synchronize() to see errors of the kernel itself.
int psa_capi_forward(int dtype, const void* x, void* y, int64_t num, int64_t feature_h,
                     int64_t feature_w, int64_t mask_h, int64_t mask_w, int psa_type,
                     void* stream) {
  clear_stale_error();
  PSA_RETURN_IF_ERROR(
      check_arguments(dtype, psa_type, num, feature_h, feature_w, mask_h, mask_w));
  const auto g = geometry(num, feature_h, feature_w, mask_h, mask_w);
  if ((g.x_numel() > 0 && x == nullptr) || (g.y_numel() > 0 && y == nullptr)) {
    return fail(kInvalidArgument, "null device pointer");
  }
  return launch_forward(dtype, x, y, g, psa_type, static_cast<cudaStream_t>(stream));
}

// Device pointers: grad_y [num, H*W, H, W] -> grad_x [num, mask_h*mask_w, H, W].
int psa_capi_backward(int dtype, const void* grad_y, void* grad_x, int64_t num,
                      int64_t feature_h, int64_t feature_w, int64_t mask_h, int64_t mask_w,
                      int psa_type, void* stream) {
  clear_stale_error();
  PSA_RETURN_IF_ERROR(
      check_arguments(dtype, psa_type, num, feature_h, feature_w, mask_h, mask_w));
  const auto g = geometry(num, feature_h, feature_w, mask_h, mask_w);
  if ((g.y_numel() > 0 && grad_y == nullptr) || (g.x_numel() > 0 && grad_x == nullptr)) {
    return fail(kInvalidArgument, "null device pointer");
  }
  return launch_backward(dtype, grad_y, grad_x, g, psa_type,
                         static_cast<cudaStream_t>(stream));
}

// Host pointers (numpy): allocates, copies x in, fills y's device buffer with
// fill_byte (0xFF is NaN in every dtype; -1 leaves it as allocated), launches,
// synchronizes, copies y back, frees.
int psa_capi_forward_host(int dtype, const void* x, void* y, int64_t num,
                          int64_t feature_h, int64_t feature_w, int64_t mask_h,
                          int64_t mask_w, int psa_type, int fill_byte) {
  clear_stale_error();
  PSA_RETURN_IF_ERROR(
      check_arguments(dtype, psa_type, num, feature_h, feature_w, mask_h, mask_w));
  const auto g = geometry(num, feature_h, feature_w, mask_h, mask_w);
  const int64_t size = dtype_size(dtype);
  return run_on_host_buffers(x, g.x_numel() * size, y, g.y_numel() * size, fill_byte,
                             [&](const void* in, void* out) {
                               return launch_forward(dtype, in, out, g, psa_type, nullptr);
                             });
}

int psa_capi_backward_host(int dtype, const void* grad_y, void* grad_x, int64_t num,
                           int64_t feature_h, int64_t feature_w, int64_t mask_h,
                           int64_t mask_w, int psa_type, int fill_byte) {
  clear_stale_error();
  PSA_RETURN_IF_ERROR(
      check_arguments(dtype, psa_type, num, feature_h, feature_w, mask_h, mask_w));
  const auto g = geometry(num, feature_h, feature_w, mask_h, mask_w);
  const int64_t size = dtype_size(dtype);
  return run_on_host_buffers(grad_y, g.y_numel() * size, grad_x, g.x_numel() * size,
                             fill_byte, [&](const void* in, void* out) {
                               return launch_backward(dtype, in, out, g, psa_type, nullptr);
                             });
}

// Timing on buffers of its own (inputs zeroed): milliseconds per forward call.
int psa_capi_time_forward(int dtype, int64_t num, int64_t feature_h, int64_t feature_w,
                          int64_t mask_h, int64_t mask_w, int psa_type, int warmup,
                          int repeats, double* ms_per_call) {
  clear_stale_error();
  PSA_RETURN_IF_ERROR(
      check_arguments(dtype, psa_type, num, feature_h, feature_w, mask_h, mask_w));
  const auto g = geometry(num, feature_h, feature_w, mask_h, mask_w);
  const int64_t size = dtype_size(dtype);
  DeviceBuffer x, y;
  PSA_RETURN_IF_ERROR(allocate(&x, g.x_numel() * size, "x"));
  PSA_RETURN_IF_ERROR(allocate(&y, g.y_numel() * size, "y"));
  if (x.ptr != nullptr) {
    PSA_CUDA_CHECK(cudaMemset(x.ptr, 0, static_cast<size_t>(g.x_numel() * size)));
  }
  return time_calls(warmup, repeats, ms_per_call,
                    [&] { return launch_forward(dtype, x.ptr, y.ptr, g, psa_type, nullptr); });
}

int psa_capi_time_backward(int dtype, int64_t num, int64_t feature_h, int64_t feature_w,
                           int64_t mask_h, int64_t mask_w, int psa_type, int warmup,
                           int repeats, double* ms_per_call) {
  clear_stale_error();
  PSA_RETURN_IF_ERROR(
      check_arguments(dtype, psa_type, num, feature_h, feature_w, mask_h, mask_w));
  const auto g = geometry(num, feature_h, feature_w, mask_h, mask_w);
  const int64_t size = dtype_size(dtype);
  DeviceBuffer grad_y, grad_x;
  PSA_RETURN_IF_ERROR(allocate(&grad_y, g.y_numel() * size, "grad_y"));
  PSA_RETURN_IF_ERROR(allocate(&grad_x, g.x_numel() * size, "grad_x"));
  if (grad_y.ptr != nullptr) {
    PSA_CUDA_CHECK(cudaMemset(grad_y.ptr, 0, static_cast<size_t>(g.y_numel() * size)));
  }
  return time_calls(warmup, repeats, ms_per_call, [&] {
    return launch_backward(dtype, grad_y.ptr, grad_x.ptr, g, psa_type, nullptr);
  });
}

// The bandwidth reference: a device-to-device cudaMemcpy of `bytes` (it reads
// and writes `bytes` each).
int psa_capi_time_copy(int64_t bytes, int warmup, int repeats, double* ms_per_call) {
  clear_stale_error();
  if (bytes < 1) return fail(kInvalidArgument, "bytes must be >= 1, got %lld",
                             static_cast<long long>(bytes));
  DeviceBuffer source, target;
  PSA_RETURN_IF_ERROR(allocate(&source, bytes, "the copy source"));
  PSA_RETURN_IF_ERROR(allocate(&target, bytes, "the copy target"));
  PSA_CUDA_CHECK(cudaMemset(source.ptr, 0, static_cast<size_t>(bytes)));
  return time_calls(warmup, repeats, ms_per_call, [&] {
    PSA_CUDA_CHECK(cudaMemcpyAsync(target.ptr, source.ptr, static_cast<size_t>(bytes),
                                   cudaMemcpyDeviceToDevice, nullptr));
    return kOk;
  });
}

}  // extern "C"
