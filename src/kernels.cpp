// SPDX-License-Identifier: MIT
// The float and double kernels, compiled once for the programs that define ATTEND_SEPARATE_KERNELS (the
// attend_kernels CMake target; detail/kernel_interface.hpp explains). Each kernel header defines its instances
// at its end when ATTEND_KERNELS_DEFINE is set.
#define ATTEND_KERNELS_DEFINE
#include <attend/attend.hpp>
