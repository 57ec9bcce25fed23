// CUDA launchers of the PSA mask op; the kernels live in psa_mask_kernel.h.
#include <vector>

#include "paddle/extension.h"
#include "psa_mask_kernel.h"

std::vector<paddle::Tensor> psa_mask_cuda_forward(const paddle::Tensor& x, int psa_type,
                                                  int mask_h, int mask_w) {
  const auto shape = x.shape();
  const auto g = psa_mask::make_geometry(shape[0], shape[2], shape[3], mask_h, mask_w);
  const auto input = x.contiguous();
  auto y = paddle::empty({g.num, g.positions(), g.feature_h, g.feature_w}, x.dtype(),
                         x.place());
  PD_DISPATCH_FLOATING_AND_HALF_TYPES(x.type(), "psa_mask_cuda_forward", ([&] {
    const cudaError_t status = psa_mask::launch_psa_mask_forward<data_t>(
        input.data<data_t>(), y.data<data_t>(), g, psa_type, x.stream());
    PD_CHECK(status == cudaSuccess, "psa_mask: CUDA forward launch failed: ",
             cudaGetErrorString(status));
  }));
  return {y};
}

std::vector<paddle::Tensor> psa_mask_cuda_backward(const paddle::Tensor& grad_y,
                                                   int psa_type, int mask_h, int mask_w) {
  // grad_y is [N, H*W, H, W]; the op checked its rank and attributes.
  const auto shape = grad_y.shape();
  const auto g = psa_mask::make_geometry(shape[0], shape[2], shape[3], mask_h, mask_w);
  const auto grad_out = grad_y.contiguous();
  auto grad_x = paddle::empty({g.num, g.mask_h * g.mask_w, g.feature_h, g.feature_w},
                              grad_y.dtype(), grad_y.place());
  PD_DISPATCH_FLOATING_AND_HALF_TYPES(grad_y.type(), "psa_mask_cuda_backward", ([&] {
    const cudaError_t status = psa_mask::launch_psa_mask_backward<data_t>(
        grad_out.data<data_t>(), grad_x.data<data_t>(), g, psa_type, grad_y.stream());
    PD_CHECK(status == cudaSuccess, "psa_mask: CUDA backward launch failed: ",
             cudaGetErrorString(status));
  }));
  return {grad_x};
}
