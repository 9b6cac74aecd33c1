"""The ``cpu`` attention backend and the CPU's native kernels: decode and prefill attention over the
paged cache, element-wise kernels, the panel GEMM, the greedy head, their C builder (``_native``)
and the lean forward that runs the layer stack as direct kernel calls."""
