"""The torch backend: ONNX converted to a torch module (``convert``), run on CUDA with a graph
per batch bucket (``engine``); batched nvJPEG decoding of uploads (``images``)."""
