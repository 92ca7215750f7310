// The fused AdamW pass (adamw_kernel.h) compiled for avx2 (CMake sets this file's flags; moments.cpp calls it only when the CPU has avx2).
#define MT_ADAMW_NS adamw_avx2
#define MT_ADAMW_AVX2 1  // this copy also has the intrinsics path for q4 (adamw_q4_avx2.h)
#include "adamw_kernel.h"
