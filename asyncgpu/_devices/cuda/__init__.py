"""The CUDA device: the real driver (``cuda.bindings``), NVRTC, cuda.core's
memory resources and launch. Imported only through ``asyncgpu._devices``, on
first use, so ``import asyncgpu`` needs no driver.

One concept per module, each importing only those below it (an import-linter
contract in pyproject.toml):

* ``backend``: ``CudaBackend`` (one device) and the process's registries;
* ``graph``: device graphs as driver graphs, replayed in stream order;
* ``stream``: ``CudaStream``: completion markers, waits, host work, faults;
* ``launch``: loaded kernels and how their arguments are passed;
* ``memory``: completion counters, device allocations, pinned host memory,
  staged copies;
* ``driver``: the driver entry (``cu``, errors, the C extension's entry
  points, plain stream-ordered driver calls);
* ``compiler``: CUDA C++ to cubin with NVRTC (no driver needed).
"""
