// The PSA mask custom operator: schema, shape and dtype inference, input
// checks, and dispatch to the CPU kernels (psa_mask_cpu.cc) or the CUDA
// launchers (psa_mask.cu).
//
// N, H and W are read from the input tensor on every call; the only attributes
// are psa_type, mask_h and mask_w, so a graph saved with a dynamic H and W
// runs at any size.
#include <cstdint>
#include <memory>
#include <vector>

#include "paddle/phi/core/dense_tensor.h"
#include "psa_mask_common.h"

// ---------------------------------------------------------------------------
// Paddle-version workarounds: records ONEDNN_LAYOUT_INPUT (4) and ENFORCE_NOT_MET (5) of
// psanet/compat/workarounds.py, which records every workaround of the project.
//
// 4. TransDataLayoutFromOneDNN, declared by hand and weak (Paddle 3.x with
//    oneDNN; no upstream issue filed). The CPU predictor with oneDNN hands a
//    custom op its input in oneDNN's blocked layout, with no reorder in front
//    as for built-in ops; to_plain_layout() below reorders it with Paddle's
//    own function, declared here because data_layout_transform.h needs oneDNN
//    headers the wheel does not ship. Weak: on a Paddle built without oneDNN
//    the symbol is absent, its address is null, and the library still loads.
// 5. PSA_MASK_CHECK and PSA_MASK_ENFORCE (psa_mask_common.h), the error path of every
//    file of the op, throw Paddle's EnforceNotMet, built by hand, not
//    PD_CHECK's PD_Exception (Paddle 3.x; none filed): the inference executor
//    keeps the message of the former only (the latter reaches the user as a
//    bare "std::exception"), and dygraph raises it as the Python error of its
//    code (InvalidArgument: ValueError).
// Neither is version-gated: 4 acts on oneDNN-layout input only, 5 throws
// Paddle's own error type. tests/test_psa_mask_export.py runs both in the
// predictor (with and without oneDNN, and a bad input reaching the kernel).
// ---------------------------------------------------------------------------
namespace phi {
namespace funcs {
__attribute__((weak)) void TransDataLayoutFromOneDNN(DataLayout in_layout,
                                                     DataLayout out_layout,
                                                     const DenseTensor& in,
                                                     DenseTensor* out, Place place,
                                                     bool always_copy);
}  // namespace funcs
}  // namespace phi

namespace {

void check_attrs(int psa_type, int mask_h, int mask_w) {
  PSA_MASK_CHECK(psa_type == psa_mask::kCollect || psa_type == psa_mask::kDistribute,
                 "psa_mask: psa_type must be 0 (collect) or 1 (distribute), got ",
                 psa_type, ".");
  PSA_MASK_CHECK(mask_h >= 1 && mask_w >= 1,
                 "psa_mask: mask_h and mask_w must be >= 1, got ", mask_h, "x", mask_w,
                 ".");
}

void check_shape(const std::vector<int64_t>& shape, int mask_h, int mask_w) {
  PSA_MASK_CHECK(shape.size() == 4,
                 "psa_mask: x must be 4-D [N, mask_h*mask_w, H, W], got rank ",
                 shape.size(), ".");
  // -1: a channel count unknown while the graph is built, checked again at run time.
  PSA_MASK_CHECK(shape[1] < 0 || shape[1] == static_cast<int64_t>(mask_h) * mask_w,
                 "psa_mask: x must have mask_h*mask_w = ", mask_h, "*", mask_w, " = ",
                 static_cast<int64_t>(mask_h) * mask_w, " channels, got ", shape[1],
                 ".");
}

void check_inputs(const paddle::Tensor& x, int psa_type, int mask_h, int mask_w) {
  check_attrs(psa_type, mask_h, mask_w);
  check_shape(x.shape(), mask_h, mask_w);
}

// The CPU inference predictor runs the ops around this one in oneDNN and, unlike
// for built-in ops, inserts no reorder before a custom op: its input may arrive
// in a blocked oneDNN layout. Reorder it to plain NCHW here.
paddle::Tensor to_plain_layout(const paddle::Tensor& x) {
  if (x.layout() != phi::DataLayout::ONEDNN) return x;
  const auto* dense = dynamic_cast<const phi::DenseTensor*>(x.impl().get());
  PSA_MASK_CHECK(dense != nullptr && &phi::funcs::TransDataLayoutFromOneDNN != nullptr,
                 "psa_mask: the input is in oneDNN layout and this Paddle offers no "
                 "reorder for it. Disable oneDNN for the predictor "
                 "(config.disable_mkldnn()).");
  auto plain = std::make_shared<phi::DenseTensor>();
  phi::funcs::TransDataLayoutFromOneDNN(phi::DataLayout::ONEDNN, phi::DataLayout::NCHW,
                                        *dense, plain.get(), phi::CPUPlace(),
                                        /*always_copy=*/false);
  return paddle::Tensor(plain);
}

// PSA_MASK_WITH_CUDA, not PADDLE_WITH_CUDA: under the latter Paddle's phi/core
// headers include cuBLAS and cuDNN headers, which a CUDA toolkit alone lacks;
// this file needs only to know that psa_mask.cu is linked in.
#ifndef PSA_MASK_WITH_CUDA
// A GPU tensor given to a library built without its CUDA kernels: on a CPU Paddle,
// or on paddlepaddle-gpu where no nvcc was found when the op was built.
constexpr const char* kNoCudaKernels =
    "psa_mask: the op library was built without CUDA kernels (no nvcc, or a CPU Paddle, "
    "when it was built); install the CUDA toolkit's nvcc of paddle.version.cuda()'s version "
    "(or set NVCC / CUDA_HOME) and rebuild (pip install --no-build-isolation ., or delete "
    "~/.cache/psanet/ops for the JIT build).";
#endif

void check_cpu(const paddle::Tensor& x) {
  PSA_MASK_CHECK(x.is_cpu(), "psa_mask: unsupported place; the op runs on CPU and GPU.");
  PSA_MASK_CHECK(x.dtype() == phi::DataType::FLOAT32 || x.dtype() == phi::DataType::FLOAT64,
                 "psa_mask: the CPU kernel takes float32 or float64, got ", x.dtype(),
                 "; cast the input with astype('float32').");
}

}  // namespace

std::vector<paddle::Tensor> PsaMaskForward(const paddle::Tensor& x, int psa_type,
                                           int mask_h, int mask_w) {
  check_inputs(x, psa_type, mask_h, mask_w);
  if (x.is_gpu()) {
#ifdef PSA_MASK_WITH_CUDA
    return psa_mask_cuda_forward(x, psa_type, mask_h, mask_w);
#else
    PSA_MASK_CHECK(false, kNoCudaKernels);
#endif
  }
  check_cpu(x);
  return psa_mask_cpu_forward(to_plain_layout(x), psa_type, mask_h, mask_w);
}

// The backward reads N, H and W off grad_y [N, H*W, H, W]: needing no x, it
// lets Paddle free the (often large) input after the forward.
std::vector<paddle::Tensor> PsaMaskBackward(const paddle::Tensor& grad_y, int psa_type,
                                            int mask_h, int mask_w) {
  check_attrs(psa_type, mask_h, mask_w);
  const auto shape = grad_y.shape();
  PSA_MASK_CHECK(shape.size() == 4 && shape[1] == shape[2] * shape[3],
                 "psa_mask: the output gradient must be [N, H*W, H, W], got rank ",
                 shape.size(), ".");
  if (grad_y.is_gpu()) {
#ifdef PSA_MASK_WITH_CUDA
    return psa_mask_cuda_backward(grad_y, psa_type, mask_h, mask_w);
#else
    PSA_MASK_CHECK(false, kNoCudaKernels);
#endif
  }
  check_cpu(grad_y);
  return psa_mask_cpu_backward(to_plain_layout(grad_y), psa_type, mask_h, mask_w);
}

std::vector<std::vector<int64_t>> PsaMaskInferShape(const std::vector<int64_t>& x_shape,
                                                    int psa_type, int mask_h,
                                                    int mask_w) {
  check_attrs(psa_type, mask_h, mask_w);
  check_shape(x_shape, mask_h, mask_w);
  const int64_t h = x_shape[2], w = x_shape[3];
  // An unknown H or W (-1, a dynamic export) keeps H*W unknown: -1 * -1 is not -1.
  const int64_t positions = (h < 0 || w < 0) ? -1 : h * w;
  return {{x_shape[0], positions, h, w}};
}

std::vector<std::vector<int64_t>> PsaMaskGradInferShape(
    const std::vector<int64_t>& grad_y_shape, int psa_type, int mask_h, int mask_w) {
  check_attrs(psa_type, mask_h, mask_w);
  PSA_MASK_CHECK(grad_y_shape.size() == 4,
                 "psa_mask: the output gradient must be 4-D [N, H*W, H, W], got rank ",
                 grad_y_shape.size(), ".");
  return {{grad_y_shape[0], static_cast<int64_t>(mask_h) * mask_w, grad_y_shape[2],
           grad_y_shape[3]}};
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
    .Inputs({paddle::Grad("Out")})
    .Outputs({paddle::Grad("X")})
    .Attrs({"psa_type: int", "mask_h: int", "mask_w: int"})
    .SetKernelFn(PD_KERNEL(PsaMaskBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(PsaMaskGradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PsaMaskInferDtype));
