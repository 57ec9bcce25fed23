// CUDA launchers of the PSA mask op; the kernels live in psa_mask_kernel.h.
#include <vector>

#include "psa_mask_common.h"

std::vector<paddle::Tensor> psa_mask_cuda_forward(const paddle::Tensor& x, int psa_type,
                                                  int mask_h, int mask_w) {
  const auto g = psa_mask::geometry_of(x, mask_h, mask_w);
  // A copy (shared storage): contiguous() is const only from Paddle 3.1.1
  // (psanet.compat.CONST_CONTIGUOUS).
  const auto input = paddle::Tensor(x).contiguous();
  auto y = psa_mask::empty_y(g, x);
  PD_DISPATCH_FLOATING_AND_HALF_TYPES(x.type(), "psa_mask_cuda_forward", ([&] {
    const cudaError_t status = psa_mask::launch_psa_mask_forward<data_t>(
        input.data<data_t>(), y.data<data_t>(), g, psa_type, x.stream());
    PSA_MASK_ENFORCE(status == cudaSuccess, EXTERNAL,
                     "psa_mask: CUDA forward launch failed: ", cudaGetErrorString(status));
  }));
  return {y};
}

std::vector<paddle::Tensor> psa_mask_cuda_backward(const paddle::Tensor& grad_y,
                                                   int psa_type, int mask_h, int mask_w) {
  const auto g = psa_mask::geometry_of(grad_y, mask_h, mask_w);
  const auto grad_out = paddle::Tensor(grad_y).contiguous();  // as above
  auto grad_x = psa_mask::empty_grad_x(g, grad_y);
  PD_DISPATCH_FLOATING_AND_HALF_TYPES(grad_y.type(), "psa_mask_cuda_backward", ([&] {
    const cudaError_t status = psa_mask::launch_psa_mask_backward<data_t>(
        grad_out.data<data_t>(), grad_x.data<data_t>(), g, psa_type, grad_y.stream());
    PSA_MASK_ENFORCE(status == cudaSuccess, EXTERNAL,
                     "psa_mask: CUDA backward launch failed: ", cudaGetErrorString(status));
  }));
  return {grad_x};
}
