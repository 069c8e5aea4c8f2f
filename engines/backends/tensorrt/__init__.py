"""The TensorRT backend: which TensorRT is installed (``runtime``), plans built into the engine
store (``build``), execution contexts on their own CUDA streams (``engine``)."""
