"""The hardware under the engines: the CPU's integer kernels, CUDA streams and buffers, NVML
gauges."""
