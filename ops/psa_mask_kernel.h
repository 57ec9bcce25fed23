// The window geometry, the index math and the CUDA kernels of the point-wise
// spatial attention (PSA) mask op.
//
// This header knows nothing of Paddle: the Paddle op (psa_mask.cc, psa_mask_cpu.cc,
// psa_mask.cu) and the standalone GPU harness (tests/gpu/) include the very same
// geometry, and the CUDA files the very same kernels.
//
// Layout (the same as mmcv's and semseg's psamask):
//   x: [N, mask_h * mask_w, H, W], channel k = i * mask_w + j is window cell (i, j).
//   y: [N, H * W, H, W], read as Y[n, a, b], positions flattened p = h * W + w.
// Cell (i, j) predicted at p = (h, w) points at q = (h + i - half_h, w + j - half_w).
//   collect    (0): Y[n, q, p] = x[n, k, h, w]
//   distribute (1): Y[n, p, q] = x[n, k, h, w]
// Every other entry of y is 0; cells whose q falls outside the map are dropped.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__CUDACC__)
#define PSA_MASK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PSA_MASK_HOST_DEVICE inline
#endif

namespace psa_mask {

// The op's psa_type values, mirroring COLLECT and DISTRIBUTE in psanet/ops/psa_mask.py.
constexpr int kCollect = 0;
constexpr int kDistribute = 1;

struct Geometry {
  int64_t num;
  int64_t feature_h;
  int64_t feature_w;
  int64_t mask_h;
  int64_t mask_w;
  int64_t half_h;
  int64_t half_w;

  PSA_MASK_HOST_DEVICE int64_t positions() const { return feature_h * feature_w; }
  PSA_MASK_HOST_DEVICE int64_t x_numel() const {
    return num * mask_h * mask_w * positions();
  }
  PSA_MASK_HOST_DEVICE int64_t y_numel() const {
    return num * positions() * positions();
  }
};

inline Geometry make_geometry(int64_t num, int64_t feature_h, int64_t feature_w,
                              int64_t mask_h, int64_t mask_w) {
  // Floor of (mask - 1) / 2: an even mask gives a lopsided window.
  return Geometry{num,    feature_h,          feature_w,         mask_h,
                  mask_w, (mask_h - 1) / 2, (mask_w - 1) / 2};
}

// The window, both ways. Cell (i, j) predicted at (h, w) points at
// (target_row(h, i), target_column(w, j)), a shift of column_shift(j) along the
// row; a shift (dh, dw) is cell (window_row(dh), window_column(dw)), off the
// window unless in [0, mask_h) x [0, mask_w). Every kernel, CPU and CUDA,
// takes its geometry from these and the column range below.
PSA_MASK_HOST_DEVICE int64_t target_row(const Geometry& g, int64_t h, int64_t i) {
  return h + i - g.half_h;
}
PSA_MASK_HOST_DEVICE int64_t target_column(const Geometry& g, int64_t w, int64_t j) {
  return w + j - g.half_w;
}
PSA_MASK_HOST_DEVICE int64_t column_shift(const Geometry& g, int64_t j) {
  return j - g.half_w;
}
PSA_MASK_HOST_DEVICE int64_t window_row(const Geometry& g, int64_t dh) { return dh + g.half_h; }
PSA_MASK_HOST_DEVICE int64_t window_column(const Geometry& g, int64_t dw) {
  return dw + g.half_w;
}

// Map columns w whose target_column(w, j) is on the map: [first_column,
// end_column), both in [0, W] (empty where the window is wider than the map).
// Host only: the CPU kernels walk these ranges, the CUDA kernels test each element.
inline int64_t first_column(const Geometry& g, int64_t j) {
  return std::min(std::max<int64_t>(0, g.half_w - j), g.feature_w);
}
inline int64_t end_column(const Geometry& g, int64_t j) {
  return std::max(std::min(g.feature_w, g.feature_w + g.half_w - j), first_column(g, j));
}

// Index into x of the value that y[y_index] holds, or -1 where y holds 0.
PSA_MASK_HOST_DEVICE int64_t y_source(const Geometry& g, int psa_type,
                                      int64_t y_index) {
  const int64_t hw = g.positions();
  const int64_t n = y_index / (hw * hw);
  const int64_t rest = y_index - n * hw * hw;
  const int64_t row = rest / hw;
  const int64_t col = rest - row * hw;
  const int64_t p = psa_type == kCollect ? col : row;
  const int64_t q = psa_type == kCollect ? row : col;
  const int64_t ph = p / g.feature_w, pw = p - ph * g.feature_w;
  const int64_t qh = q / g.feature_w, qw = q - qh * g.feature_w;
  const int64_t i = window_row(g, qh - ph);
  const int64_t j = window_column(g, qw - pw);
  if (i < 0 || i >= g.mask_h || j < 0 || j >= g.mask_w) return -1;
  return ((n * g.mask_h * g.mask_w + i * g.mask_w + j) * hw) + p;
}

// Index into y whose gradient flows back to x[x_index], or -1 where the cell
// points outside the map (its gradient is 0).
PSA_MASK_HOST_DEVICE int64_t x_target(const Geometry& g, int psa_type,
                                      int64_t x_index) {
  const int64_t hw = g.positions();
  const int64_t cells = g.mask_h * g.mask_w;
  const int64_t n = x_index / (cells * hw);
  const int64_t rest = x_index - n * cells * hw;
  const int64_t k = rest / hw;
  const int64_t p = rest - k * hw;
  const int64_t i = k / g.mask_w, j = k - i * g.mask_w;
  const int64_t h = p / g.feature_w, w = p - h * g.feature_w;
  const int64_t qh = target_row(g, h, i);
  const int64_t qw = target_column(g, w, j);
  if (qh < 0 || qh >= g.feature_h || qw < 0 || qw >= g.feature_w) return -1;
  const int64_t q = qh * g.feature_w + qw;
  return psa_type == kCollect ? (n * hw + q) * hw + p : (n * hw + p) * hw + q;
}

#if defined(__CUDACC__)

// One thread per element of y, grid-stride. Every element is written exactly
// once (0 outside the window), so the output needs no separate zero fill and
// no thread ever races a fill.
template <typename T>
__global__ void psa_mask_forward_kernel(const T* __restrict__ x, T* __restrict__ y,
                                        Geometry g, int psa_type) {
  const int64_t total = g.y_numel();
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < total; index += stride) {
    const int64_t source = y_source(g, psa_type, index);
    y[index] = source >= 0 ? x[source] : static_cast<T>(0.0f);
  }
}

// One thread per element of x: the matching gather, 0 for cells off the map.
template <typename T>
__global__ void psa_mask_backward_kernel(const T* __restrict__ grad_y,
                                         T* __restrict__ grad_x, Geometry g,
                                         int psa_type) {
  const int64_t total = g.x_numel();
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < total; index += stride) {
    const int64_t target = x_target(g, psa_type, index);
    grad_x[index] = target >= 0 ? grad_y[target] : static_cast<T>(0.0f);
  }
}

constexpr int kThreadsPerBlock = 256;
// Enough blocks to fill any current GPU; the grid-stride loop covers the rest.
constexpr int64_t kMaxBlocks = 4096;

inline unsigned int blocks_for(int64_t total) {
  int64_t blocks = (total + kThreadsPerBlock - 1) / kThreadsPerBlock;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned int>(blocks < 1 ? 1 : blocks);
}

template <typename T>
cudaError_t launch_psa_mask_forward(const T* x, T* y, const Geometry& g,
                                    int psa_type, cudaStream_t stream) {
  if (g.y_numel() == 0) return cudaSuccess;
  psa_mask_forward_kernel<T><<<blocks_for(g.y_numel()), kThreadsPerBlock, 0, stream>>>(
      x, y, g, psa_type);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_psa_mask_backward(const T* grad_y, T* grad_x, const Geometry& g,
                                     int psa_type, cudaStream_t stream) {
  if (g.x_numel() == 0) return cudaSuccess;
  psa_mask_backward_kernel<T><<<blocks_for(g.x_numel()), kThreadsPerBlock, 0, stream>>>(
      grad_y, grad_x, g, psa_type);
  return cudaGetLastError();
}

#endif  // __CUDACC__

}  // namespace psa_mask
