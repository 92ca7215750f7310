// Row-major arrays seen as Eigen matrices, for the ops that multiply through Eigen (linear,
// attention). Internal to kernels/cpu/, like detail.h.
#pragma once

// GCC 12 reports false "(may be) used uninitialized" warnings inside Eigen's AVX-512 packet code
// (_mm256_undefined_pd); the diagnostics are emitted where Eigen is inlined, i.e. in the including file.
#ifndef __clang__  // a GCC-only warning; clang warns about the name
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>

namespace megatrain::cpu::detail {

template <typename T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using CMap = Eigen::Map<const RowMat<T>, 0, Eigen::OuterStride<>>;
template <typename T>
using MMap = Eigen::Map<RowMat<T>, 0, Eigen::OuterStride<>>;

}  // namespace megatrain::cpu::detail
