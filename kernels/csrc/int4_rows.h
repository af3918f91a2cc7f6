// The row kernels' 4-bit linear (int4_rows.cpp), for the other row kernels that call it directly.
#pragma once

#include <ATen/core/Tensor.h>

namespace pagedserve {

// x [rows, in] fp32 contiguous, packed [out / 8, in / 32, 160] uint8 -> [rows, out] fp32
// (int4_rows.cpp says how).
at::Tensor int4_rows_linear(const at::Tensor& x, const at::Tensor& packed);

}  // namespace pagedserve
