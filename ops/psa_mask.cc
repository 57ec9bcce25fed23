// The PSA mask custom operator: schema, shape and dtype inference, input
// checks, CPU kernels, and dispatch to the CUDA kernels (psa_mask.cu).
//
// N, H and W are read from the input tensor on every call; the only attributes
// are psa_type, mask_h and mask_w, so a graph saved with a dynamic H and W
// runs at any size.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "paddle/extension.h"
#include "psa_mask_kernel.h"

namespace {

void check_inputs(const paddle::Tensor& x, int psa_type, int mask_h, int mask_w) {
  PD_CHECK(psa_type == psa_mask::kCollect || psa_type == psa_mask::kDistribute,
           "psa_mask: psa_type must be 0 (collect) or 1 (distribute), got ",
           psa_type, ".");
  PD_CHECK(mask_h >= 1 && mask_w >= 1,
           "psa_mask: mask_h and mask_w must be >= 1, got ", mask_h, "x", mask_w,
           ".");
  PD_CHECK(x.layout() != phi::DataLayout::ONEDNN,
           "psa_mask: the input is in oneDNN layout, which this op cannot read. "
           "Disable oneDNN for the predictor (config.disable_mkldnn()) or use "
           "psanet.deploy.create_predictor, which does so.");
  const auto shape = x.shape();
  PD_CHECK(shape.size() == 4,
           "psa_mask: x must be 4-D [N, mask_h*mask_w, H, W], got rank ",
           shape.size(), ".");
  PD_CHECK(shape[1] == static_cast<int64_t>(mask_h) * mask_w,
           "psa_mask: x must have mask_h*mask_w = ", mask_h * mask_w,
           " channels, got ", shape[1], ".");
}

psa_mask::Geometry geometry_of(const paddle::Tensor& x, int mask_h, int mask_w) {
  const auto shape = x.shape();
  return psa_mask::make_geometry(shape[0], shape[2], shape[3], mask_h, mask_w);
}

int thread_count(int64_t units, int64_t elements) {
  // Spawning threads costs tens of microseconds: small ops stay on one.
  constexpr int64_t kMinElementsPerThread = 1 << 16;
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  if (const char* env = std::getenv("PSA_MASK_NUM_THREADS")) {
    threads = std::atoi(env);
  }
  threads = std::max(threads, 1);
  threads = static_cast<int>(std::min<int64_t>(threads, units));
  threads = static_cast<int>(
      std::min<int64_t>(threads, std::max<int64_t>(elements / kMinElementsPerThread, 1)));
  return std::max(threads, 1);
}

// Runs fn(unit) for unit in [0, units), split in contiguous chunks over threads.
template <typename Fn>
void parallel_for(int64_t units, int64_t elements, const Fn& fn) {
  const int threads = thread_count(units, elements);
  if (threads <= 1) {
    for (int64_t unit = 0; unit < units; ++unit) fn(unit);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  auto run_chunk = [&](int t) {
    const int64_t begin = units * t / threads;
    const int64_t end = units * (t + 1) / threads;
    for (int64_t unit = begin; unit < end; ++unit) fn(unit);
  };
  for (int t = 1; t < threads; ++t) pool.emplace_back(run_chunk, t);
  run_chunk(0);
  for (auto& thread : pool) thread.join();
}

// Forward. A work unit is the block of W rows of Y whose row position has
// height h: it is zeroed while it sits in cache, then each window cell writes
// one run along w, reading x contiguously. Units never share output memory.
template <typename T>
void psa_mask_forward_cpu(const T* x, T* y, const psa_mask::Geometry& g, int psa_type) {
  const int64_t H = g.feature_h, W = g.feature_w, hw = g.positions();
  const bool collect = psa_type == psa_mask::kCollect;
  parallel_for(g.num * H, g.y_numel(), [&](int64_t unit) {
    const int64_t n = unit / H, h = unit - n * H;
    T* y_block = y + (n * hw + h * W) * hw;
    std::fill(y_block, y_block + W * hw, static_cast<T>(0));
    const T* x_n = x + n * g.mask_h * g.mask_w * hw;
    for (int64_t i = 0; i < g.mask_h; ++i) {
      // collect: the row is q = (h, w) and x sits at p = q - offset;
      // distribute: the row is p = (h, w) and the column is q = p + offset.
      const int64_t dh = collect ? g.half_h - i : i - g.half_h;
      const int64_t other_h = h + dh;
      if (other_h < 0 || other_h >= H) continue;
      for (int64_t j = 0; j < g.mask_w; ++j) {
        const int64_t dw = collect ? g.half_w - j : j - g.half_w;
        const int64_t w_begin = std::max<int64_t>(0, -dw);
        const int64_t w_end = std::min<int64_t>(W, W - dw);
        const T* x_k = x_n + (i * g.mask_w + j) * hw;
        const T* source = collect ? x_k + other_h * W + dw : x_k + h * W;
        T* target = y_block + other_h * W + dw;
        for (int64_t w = w_begin; w < w_end; ++w) target[w * hw + w] = source[w];
      }
    }
  });
}

// Backward: the matching gather. A work unit is row h of every channel of
// grad_x (one sample); cells pointing off the map get 0.
template <typename T>
void psa_mask_backward_cpu(const T* grad_y, T* grad_x, const psa_mask::Geometry& g,
                           int psa_type) {
  const int64_t H = g.feature_h, W = g.feature_w, hw = g.positions();
  const bool collect = psa_type == psa_mask::kCollect;
  parallel_for(g.num * H, g.x_numel(), [&](int64_t unit) {
    const int64_t n = unit / H, h = unit - n * H;
    const T* grad_y_n = grad_y + n * hw * hw;
    for (int64_t i = 0; i < g.mask_h; ++i) {
      const int64_t qh = h + i - g.half_h;
      for (int64_t j = 0; j < g.mask_w; ++j) {
        T* row = grad_x + ((n * g.mask_h * g.mask_w + i * g.mask_w + j) * H + h) * W;
        if (qh < 0 || qh >= H) {
          std::fill(row, row + W, static_cast<T>(0));
          continue;
        }
        const int64_t dw = j - g.half_w;
        const int64_t w_begin = std::max<int64_t>(0, -dw);
        const int64_t w_end = std::min<int64_t>(W, W - dw);
        std::fill(row, row + w_begin, static_cast<T>(0));
        std::fill(row + w_end, row + W, static_cast<T>(0));
        // Y[q, p] (collect) or Y[p, q] (distribute), p = (h, w), q = (qh, w + dw).
        const T* source = collect ? grad_y_n + (qh * W + dw) * hw + h * W
                                  : grad_y_n + h * W * hw + qh * W + dw;
        for (int64_t w = w_begin; w < w_end; ++w) row[w] = source[w * hw + w];
      }
    }
  });
}

}  // namespace

#ifdef PADDLE_WITH_CUDA
std::vector<paddle::Tensor> psa_mask_cuda_forward(const paddle::Tensor& x, int psa_type,
                                                  int mask_h, int mask_w);
std::vector<paddle::Tensor> psa_mask_cuda_backward(const paddle::Tensor& x,
                                                   const paddle::Tensor& grad_y,
                                                   int psa_type, int mask_h, int mask_w);
#endif

std::vector<paddle::Tensor> PsaMaskForward(const paddle::Tensor& x, int psa_type,
                                           int mask_h, int mask_w) {
  check_inputs(x, psa_type, mask_h, mask_w);
  if (x.is_gpu()) {
#ifdef PADDLE_WITH_CUDA
    return psa_mask_cuda_forward(x, psa_type, mask_h, mask_w);
#else
    PD_THROW("psa_mask: the op library was built without CUDA; rebuild it on a "
             "CUDA machine with paddlepaddle-gpu (python setup.py install).");
#endif
  }
  PD_CHECK(x.is_cpu(), "psa_mask: unsupported place; the op runs on CPU and GPU.");
  const auto g = geometry_of(x, mask_h, mask_w);
  const auto input = x.contiguous();
  auto y = paddle::empty({g.num, g.positions(), g.feature_h, g.feature_w}, x.dtype(),
                         paddle::CPUPlace());
  PD_DISPATCH_FLOATING_TYPES(x.type(), "psa_mask_forward_cpu", ([&] {
                               psa_mask_forward_cpu<data_t>(input.data<data_t>(),
                                                            y.data<data_t>(), g,
                                                            psa_type);
                             }));
  return {y};
}

std::vector<paddle::Tensor> PsaMaskBackward(const paddle::Tensor& x,
                                            const paddle::Tensor& grad_y, int psa_type,
                                            int mask_h, int mask_w) {
  check_inputs(x, psa_type, mask_h, mask_w);
  if (x.is_gpu()) {
#ifdef PADDLE_WITH_CUDA
    return psa_mask_cuda_backward(x, grad_y, psa_type, mask_h, mask_w);
#else
    PD_THROW("psa_mask: the op library was built without CUDA.");
#endif
  }
  const auto g = geometry_of(x, mask_h, mask_w);
  PD_CHECK(grad_y.numel() == g.y_numel(), "psa_mask: the output gradient has ",
           grad_y.numel(), " elements, expected ", g.y_numel(), ".");
  const auto grad_out = grad_y.contiguous();
  auto grad_x = paddle::empty(x.shape(), x.dtype(), paddle::CPUPlace());
  PD_DISPATCH_FLOATING_TYPES(x.type(), "psa_mask_backward_cpu", ([&] {
                               psa_mask_backward_cpu<data_t>(grad_out.data<data_t>(),
                                                             grad_x.data<data_t>(), g,
                                                             psa_type);
                             }));
  return {grad_x};
}

std::vector<std::vector<int64_t>> PsaMaskInferShape(const std::vector<int64_t>& x_shape,
                                                    int psa_type, int mask_h,
                                                    int mask_w) {
  PD_CHECK(x_shape.size() == 4,
           "psa_mask: x must be 4-D [N, mask_h*mask_w, H, W], got rank ",
           x_shape.size(), ".");
  const int64_t h = x_shape[2], w = x_shape[3];
  // An unknown H or W (-1, a dynamic export) keeps H*W unknown: -1 * -1 is not -1.
  const int64_t positions = (h < 0 || w < 0) ? -1 : h * w;
  return {{x_shape[0], positions, h, w}};
}

std::vector<paddle::DataType> PsaMaskInferDtype(const paddle::DataType& x_dtype) {
  return {x_dtype};
}

PD_BUILD_OP(psa_mask)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"psa_type: int", "mask_h: int", "mask_w: int"})
    .SetKernelFn(PD_KERNEL(PsaMaskForward))
    .SetInferShapeFn(PD_INFER_SHAPE(PsaMaskInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PsaMaskInferDtype));

PD_BUILD_GRAD_OP(psa_mask)
    .Inputs({"X", paddle::Grad("Out")})
    .Outputs({paddle::Grad("X")})
    .Attrs({"psa_type: int", "mask_h: int", "mask_w: int"})
    .SetKernelFn(PD_KERNEL(PsaMaskBackward));
