// All CPU ops (megatrain::cpu), the reference backend: one include for the executor.
// Each op's header documents its math, shapes, what forward saves and its determinism.
#pragma once

#include "megatrain/kernels/cpu/add.h"
#include "megatrain/kernels/cpu/attention.h"
#include "megatrain/kernels/cpu/context.h"
#include "megatrain/kernels/cpu/cross_entropy.h"
#include "megatrain/kernels/cpu/embedding.h"
#include "megatrain/kernels/cpu/linear.h"
#include "megatrain/kernels/cpu/rmsnorm.h"
#include "megatrain/kernels/cpu/rope.h"
#include "megatrain/kernels/cpu/swiglu.h"
