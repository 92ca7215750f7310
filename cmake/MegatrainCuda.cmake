# Enables CUDA with C++20. CMake 3.25 does not know C++20 for nvcc, so we teach it here
# (see ../shared/design/ENVIRONMENT.md); cudart is linked shared so it is not linked twice.
set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
if(MEGATRAIN_BUNDLE)
  set(CMAKE_CUDA_RUNTIME_LIBRARY None)  # CUDA::cudart_static is linked explicitly (MEGATRAIN_CUDART)
endif()
# -DMEGATRAIN_CUDA_ARCHITECTURES=80 (or CMake's own -DCMAKE_CUDA_ARCHITECTURES=80) overrides the 90 default.
if(DEFINED CACHE{CMAKE_CUDA_ARCHITECTURES} AND NOT "$CACHE{CMAKE_CUDA_ARCHITECTURES}" STREQUAL "")
  set(MEGATRAIN_CUDA_ARCHITECTURES "$CACHE{CMAKE_CUDA_ARCHITECTURES}" CACHE STRING "CUDA architectures" FORCE)
endif()
set(CMAKE_CUDA_ARCHITECTURES "${MEGATRAIN_CUDA_ARCHITECTURES}")
enable_language(CUDA)
list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)
# The CUDA runtime our targets link: shared normally, static in a bundle to carry (MEGATRAIN_BUNDLE).
if(MEGATRAIN_BUNDLE)
  set(MEGATRAIN_CUDART CUDA::cudart_static)
else()
  set(MEGATRAIN_CUDART CUDA::cudart)
endif()
