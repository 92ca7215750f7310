// The fused AdamW pass (adamw_kernel.h) compiled for avx512 (CMake sets this file's flags; moments.cpp calls it only when the CPU has avx512).
#define MT_ADAMW_NS adamw_avx512
// GCC 12's AVX-512 headers build many intrinsics on _mm512_undefined_*(), which it then reports as
// "'__Y' is used uninitialized" (GCC bug 105593, fixed in GCC 13); nothing here is uninitialised.
#pragma GCC diagnostic ignored "-Wuninitialized"
#ifndef __clang__  // a GCC-only warning; clang warns about the name
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define MT_ADAMW_AVX512 1  // this copy also has the intrinsics path for q4 and q8 (adamw_q_avx512.h)
#include "adamw_kernel.h"
