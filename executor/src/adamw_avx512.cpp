// The fused AdamW pass (adamw_kernel.h) compiled for avx512 (CMake sets this file's flags; moments.cpp calls it only when the CPU has avx512).
#define MT_ADAMW_NS adamw_avx512
#include "adamw_kernel.h"
