// Macros shared by the host and device halves of the plain headers.
#pragma once

// Functions of the plain headers (params.h, mask.h, dropout.h, math.h) are
// compiled for the device too when nvcc includes them, and inlined there.
#if defined(__CUDACC__)
#define JAX_FLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JAX_FLASH_HOST_DEVICE inline
#endif
