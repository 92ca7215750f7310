# Enables CUDA with C++20. CMake 3.25 does not know C++20 for nvcc, so we teach it here
# (see ../shared/design/ENVIRONMENT.md); cudart is linked shared so it is not linked twice.
set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
set(CMAKE_CUDA_ARCHITECTURES "${MEGATRAIN_CUDA_ARCHITECTURES}")
enable_language(CUDA)
list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)
