"""The CUDA device: the real driver (``cuda.bindings``), NVRTC, cuda.core's
memory resources and launch. Imported only through ``asyncgpu._devices``, on
first use, so ``import asyncgpu`` needs no driver."""
