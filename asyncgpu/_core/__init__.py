"""The device-neutral core: events, the stream seam, the completion engine, the
CPU pool, memory and operands, functions and tracing.

Everything here imports only the leaves (``_types``, ``_errors``, ``_config``,
``_version``) and the compiled layer (``_accel``); it never names a device. A
device plugs in below the seam in ``stream`` (``_StreamImpl``) and through the
``Backend`` protocol in ``protocols``.
"""
