"""Precision variants: FP16 and INT8 graphs derived from the FP32 ONNX, calibrated, measured
against FP32 and kept in the engine store (``build.ensure_variant``)."""
