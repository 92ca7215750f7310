// The fused AdamW pass (adamw_kernel.h) compiled for the baseline x86-64 instruction set (the fallback).
#define MT_ADAMW_NS adamw_scalar
#include "adamw_kernel.h"
