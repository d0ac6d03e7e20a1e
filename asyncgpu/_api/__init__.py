"""The public face: ``DeviceContext``, ``DeviceStream`` and the interop entry
points (DLPack, ``__cuda_array_interface__``, numba-cuda kernels). It imports the
core and chooses a device through ``_devices`` only."""
