// Two simpler CUDA layouts of the PSA mask op, which run_gpu_checks.py times beside
// the op's tiled kernels (ops/psa_mask_kernel.h) in the same run:
// - "landed": one thread per output element gathers its value (y_source /
//   x_target of the header), grid-stride; the op's kernels before the tiled ones;
// - "per position": one thread per (n, h, w) walks its window cells: forward
//   zero-fills y (cudaMemsetAsync) and scatters, backward gathers grad_x.
// They move the same bits as the op's kernels; psa_mask_capi.cu runs and times
// any of the three.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../ops/psa_mask_kernel.h"

namespace psa_mask_baselines {

using psa_mask::Geometry;

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kMaxBlocks = 4096;  // the grid-stride loops cover the rest

inline unsigned int blocks_for(int64_t total) {
  int64_t blocks = (total + kThreadsPerBlock - 1) / kThreadsPerBlock;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned int>(blocks < 1 ? 1 : blocks);
}

// Forward: thread per element of y; backward: per element of grad_x.
template <typename Bits>
__global__ void landed(const Bits* in, Bits* out, Geometry g, int psa_type, bool forward) {
  const int64_t total = forward ? g.y_numel() : g.x_numel();
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < total; index += stride) {
    const int64_t other = forward ? psa_mask::y_source(g, psa_type, index)
                                  : psa_mask::x_target(g, psa_type, index);
    out[index] = other >= 0 ? in[other] : Bits(0);
  }
}

// Thread (n, p): for each cell (i, j) on the map, the entry of Y it moves.
template <typename Bits>
__global__ void per_position(const Bits* in, Bits* out, Geometry g, int psa_type,
                             bool forward) {
  const int64_t hw = g.positions();
  const int64_t total = g.num * hw;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < total; index += stride) {
    const int64_t n = index / hw, p = index - n * hw;
    const int64_t h = p / g.feature_w, w = p - h * g.feature_w;
    for (int64_t i = 0; i < g.mask_h; ++i) {
      const int64_t qh = psa_mask::target_row(g, h, i);
      for (int64_t j = 0; j < g.mask_w; ++j) {
        const int64_t qw = psa_mask::target_column(g, w, j);
        const int64_t x_index = (n * g.mask_h * g.mask_w + i * g.mask_w + j) * hw + p;
        const bool on_map = qh >= 0 && qh < g.feature_h && qw >= 0 && qw < g.feature_w;
        const int64_t q = qh * g.feature_w + qw;
        const int64_t y_index =
            psa_type == psa_mask::kCollect ? (n * hw + q) * hw + p : (n * hw + p) * hw + q;
        if (forward) {
          if (on_map) out[y_index] = in[x_index];
        } else {
          out[x_index] = on_map ? in[y_index] : Bits(0);
        }
      }
    }
  }
}

// baseline 1: landed, 2: per position; forward (direction 0) or backward.
template <typename T>
cudaError_t launch(int baseline, int direction, const T* input, T* output, const Geometry& g,
                   int psa_type, cudaStream_t stream) {
  using Bits = typename psa_mask::BitsOf<sizeof(T)>::type;
  const Bits* in = reinterpret_cast<const Bits*>(input);
  Bits* out = reinterpret_cast<Bits*>(output);
  const int64_t outputs = direction == 0 ? g.y_numel() : g.x_numel();
  if (outputs == 0) return cudaSuccess;
  if (baseline == 1) {
    landed<Bits><<<blocks_for(outputs), kThreadsPerBlock, 0, stream>>>(in, out, g, psa_type,
                                                                        direction == 0);
    return cudaGetLastError();
  }
  if (direction == 0) {
    const cudaError_t status = cudaMemsetAsync(out, 0, outputs * sizeof(Bits), stream);
    if (status != cudaSuccess) return status;
  }
  per_position<Bits><<<blocks_for(g.num * g.positions()), kThreadsPerBlock, 0, stream>>>(
      in, out, g, psa_type, direction == 0);
  return cudaGetLastError();
}

}  // namespace psa_mask_baselines
