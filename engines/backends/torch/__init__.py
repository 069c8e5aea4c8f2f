"""The torch backend: ONNX converted to a torch module (``convert``) in a precision
(``precision``), loaded as an engine (``engine``) whose runners run it on CUDA with a graph per
batch bucket (``runner``), staging batches through pinned buffers (``staging``) under a cap on
GPU memory (``memory``), compiled by ``torch.compile`` if asked (``compiled``); batched nvJPEG
decoding of uploads (``images``)."""
