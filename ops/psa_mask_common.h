// What the files of the PSA mask op share: the entry points of the CPU kernels
// (psa_mask_cpu.cc) and of the CUDA launchers (psa_mask.cu), which psa_mask.cc
// dispatches to, and the one way they all report an error.
//
// Each entry point takes the attributes psa_mask.cc has checked, and a tensor
// of the right rank, channels and dtype on its device (on the CPU, in plain
// layout); it returns the one output, every element written.
#pragma once

#include <vector>

#include "paddle/common/enforce.h"
#include "paddle/extension.h"
#include "psa_mask_kernel.h"

namespace psa_mask {

// N, H and W, read off x [N, mask_h*mask_w, H, W] or grad_y [N, H*W, H, W] alike.
inline Geometry geometry_of(const paddle::Tensor& t, int mask_h, int mask_w) {
  const auto shape = t.shape();
  return make_geometry(shape[0], shape[2], shape[3], mask_h, mask_w);
}

// The outputs, of the input's dtype and place, left unfilled: the kernels
// write every element. The forward's y [N, H*W, H, W]:
inline paddle::Tensor empty_y(const Geometry& g, const paddle::Tensor& x) {
  return paddle::empty({g.num, g.positions(), g.feature_h, g.feature_w}, x.dtype(),
                       x.place());
}
// and the backward's grad_x [N, mask_h*mask_w, H, W].
inline paddle::Tensor empty_grad_x(const Geometry& g, const paddle::Tensor& grad_y) {
  return paddle::empty({g.num, g.mask_h * g.mask_w, g.feature_h, g.feature_w},
                       grad_y.dtype(), grad_y.place());
}

}  // namespace psa_mask

std::vector<paddle::Tensor> psa_mask_cpu_forward(const paddle::Tensor& x, int psa_type,
                                                 int mask_h, int mask_w);
// grad_y is [N, H*W, H, W]: the backward needs no x.
std::vector<paddle::Tensor> psa_mask_cpu_backward(const paddle::Tensor& grad_y,
                                                  int psa_type, int mask_h, int mask_w);

// Defined only in a library built with the CUDA kernels (PSA_MASK_WITH_CUDA).
std::vector<paddle::Tensor> psa_mask_cuda_forward(const paddle::Tensor& x, int psa_type,
                                                  int mask_h, int mask_w);
std::vector<paddle::Tensor> psa_mask_cuda_backward(const paddle::Tensor& grad_y,
                                                   int psa_type, int mask_h, int mask_w);

// Throws Paddle's EnforceNotMet with the ::common::ErrorCode CODE and a message
// of the arguments, unless COND holds: built by hand, not PD_CHECK, for the
// reason in workaround 5 at the top of psa_mask.cc.
#define PSA_MASK_ENFORCE(COND, CODE, ...)                                         \
  do {                                                                            \
    if (!(COND)) {                                                                \
      throw ::common::enforce::EnforceNotMet(                                     \
          ::common::ErrorSummary(::common::ErrorCode::CODE,                       \
                                 ::common::ErrorMessage(__VA_ARGS__).to_string()), \
          __FILE__, __LINE__);                                                    \
    }                                                                             \
  } while (0)

// A bad input or attribute: InvalidArgument, which dygraph raises as a ValueError.
#define PSA_MASK_CHECK(COND, ...) PSA_MASK_ENFORCE(COND, INVALID_ARGUMENT, __VA_ARGS__)
