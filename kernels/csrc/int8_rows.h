// The row kernels' int8 linear (int8_rows.cpp), for the other row kernels that call it directly.
#pragma once

#include <ATen/core/Tensor.h>

namespace pagedserve {

// x [rows, in] fp32 contiguous, packed [out / 64, in / 4, 4, 16, 4] int8,
// colsum [out padded to 64] int32,
// weight_scales [out] fp32 -> [rows, out] fp32 (int8_rows.cpp says how).
at::Tensor int8_rows_linear(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& colsum, const at::Tensor& weight_scales);

}  // namespace pagedserve
