"""The ``triton`` attention backend: the Triton kernels (``_kernels``), their launchers and the
static metadata CUDA graphs replay."""
