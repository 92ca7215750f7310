// The fused AdamW pass (adamw_kernel.h) compiled for avx2 (CMake sets this file's flags; moments.cpp calls it only when the CPU has avx2).
#define MT_ADAMW_NS adamw_avx2
#include "adamw_kernel.h"
