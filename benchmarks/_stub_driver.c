/* A stand-in for the four driver entry points that asyncgpu._native calls, for
 * benchmarks/emulate_engine.py: a launch that does nothing, a counter write that
 * the "GPU" performs at once, an event record that does nothing and an event
 * query that says finished. Compiled by that script with the system's C compiler. */
int stub_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                unsigned bz, unsigned shmem, void *stream, void **params, void **extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem;
    (void)stream; (void)params; (void)extra;
    return 0;
}

int stub_write64(void *stream, unsigned long long addr, unsigned long long value, unsigned flags) {
    (void)stream; (void)flags;
    *(volatile unsigned long long *)addr = value;
    return 0;
}

/* The same, writing nothing: the emulated GPU writes the counters itself, later. */
int stub_write64_deferred(void *stream, unsigned long long addr, unsigned long long value,
                          unsigned flags) {
    (void)stream; (void)addr; (void)value; (void)flags;
    return 0;
}

int stub_record(void *event, void *stream) {
    (void)event; (void)stream;
    return 0;
}

int stub_query(void *event) {
    (void)event;
    return 0;
}
