"""How each precision variant is made and what it may cost, declared once.

These pydantic models are also the model config's sections (``fp16:``, ``int8:``,
``accuracy.budgets``): the service validates them and the engine layer takes them as they
are. ``int8_recipe`` decides the INT8 form and weight width from the backend and the CPU's
integer kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engines.devices import cpu

Int8Form = Literal["u8s8", "s8s8"]
BUILTIN_CALIBRATION = "builtin"


# What FP16 may differ from FP32 by on a model without preprocessing, relative to each
# output's scale (``Budget.max_relative_error``). FP16 keeps 11 significant bits (0.05% per
# rounding) and a network's roundings add up (measured on 100 photos: 0.5% on the shipped
# EfficientNet-Lite0's logits, 0.05% on ResNet-50's); what a broken conversion does (an
# overflow to inf, a flushed or clamped weight) is off by far more than 2%.
FP16_TOLERANCE = 2e-2


# The precision options are declared once, here, and are also the model config's sections
# (``fp16:``, ``int8:``, ``accuracy.budgets``): pydantic models the service validates and the
# engine layer takes as they are.
_OPTIONS = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)


class Fp16Options(BaseModel):
    """How the fp16 variant is made."""

    model_config = _OPTIONS

    keep_fp32_ops: tuple[str, ...] | None = None
    """Op types kept in FP32; None keeps the default set (Softmax, LayerNormalization,
    reductions...). More ops in FP32 cost speed and buy accuracy."""
    keep_fp32_nodes: tuple[str, ...] = ()
    """Node names kept in FP32."""
    keep_first_and_last: bool = False
    """Keep the first and last weight layers in FP32 (they are often the most sensitive)."""


class Int8Options(BaseModel):
    """How the int8 variant is calibrated and quantized."""

    model_config = _OPTIONS

    calibrator: Literal["entropy", "percentile", "minmax", "auto"] = "entropy"
    """How activation ranges are chosen: entropy (TensorRT's KL threshold), percentile,
    minmax, or auto (tries each and keeps the lowest KL on a held-out slice: slower)."""
    percentile: float = Field(default=99.99, gt=50, le=100)
    """Percentile of |x| kept by the percentile calibrator."""
    samples: int = Field(default=500, gt=0)
    """Calibration rows. More rows give steadier ranges and take longer, once: ranges are
    cached in the engine store."""
    calibration: str = BUILTIN_CALIBRATION
    """A folder of images (or .npy/.npz rows), relative to the model folder, run through the
    model's preprocessing; also the rows every variant is checked on. ``builtin`` uses
    augmented public-domain photos shipped with scikit-image, which works offline but is less
    representative than your own data. A model without preprocessing takes .npy/.npz rows
    (a file, or a folder of them) as its input takes them: with ``builtin`` its int8 variant
    is refused, and fp16 is checked on seeded random rows of its inputs' spec."""
    exclude_op_types: tuple[str, ...] = ()
    """Op types left unquantized."""
    exclude_nodes: tuple[str, ...] = ()
    """Node names left unquantized (sensitive layers)."""
    reduce_range: bool | None = None
    """Quantize weights to 7 bits. None (auto): on x86 CPUs without VNNI, whose integer
    kernels saturate with 8-bit weights (``engines.devices.cpu``; a few points of top-1 lost there,
    none elsewhere). 7 bits cost a little accuracy where nothing saturates."""
    keep_first_and_last: bool | None = None
    """Leave the first and last weight layers in float. None (auto): as ``reduce_range``,
    where they recover what 7-bit weights lose, for a few percent of speed."""


@dataclass(frozen=True)
class Int8Recipe:
    """How the INT8 variant is quantized for one backend on one machine."""

    form: Int8Form
    reduce_range: bool
    keep_first_and_last: bool
    kernels: str
    """The integer kernels the recipe was chosen for (``cpu.IntegerKernels.name``, or the
    backend's name for a GPU)."""
    gate_fused: bool
    """Judge the variant as ONNX Runtime serves it, Q/DQ fused into this CPU's integer
    kernels; False (TensorRT): with its Q/DQ graph run in float, as a GPU computes it, which
    no CPU's int16 saturation can distort."""

    def describe(self) -> str:
        edges = ", first and last layers in float" if self.keep_first_and_last else ""
        bits = 7 if self.reduce_range else 8
        return f"{self.form}, {bits}-bit weights{edges}, for {self.kernels}"


class Budget(BaseModel):
    """The least a variant must keep of FP32's answers on the evaluation set."""

    model_config = _OPTIONS

    min_top1_agreement: float = Field(default=0.98, ge=0, le=1)
    """Top-1 agreement with FP32 on the held-out rows."""
    max_mean_kl: float | None = Field(default=None, ge=0)
    """Mean KL divergence of the softmax from FP32's; None: not checked."""
    max_relative_error: float | None = Field(default=None, ge=0)
    """The largest difference from FP32 of any output value, relative to that output's
    largest FP32 value. A model without preprocessing (its outputs are not known to be class
    scores) has its fp16 variant judged by this alone; None: ``FP16_TOLERANCE`` there, and
    not checked elsewhere. Smaller is stricter; FP16 rounds to 0.05% per operation."""


def int8_recipe(
    backend: str, options: Int8Options, kernels: cpu.IntegerKernels | None = None
) -> Int8Recipe:
    """The INT8 recipe for ``backend``: symmetric S8S8 with 8-bit weights for TensorRT; U8S8
    (ONNX Runtime's fast CPU form) for the rest, with 7-bit weights and the first and last
    layers in float where the CPU's kernels saturate, unless the options say otherwise."""
    if backend == "tensorrt":
        saturates, name = False, backend
    else:
        kernels = kernels or cpu.integer_kernels()
        saturates, name = kernels.saturates, kernels.name

    def choose(option: bool | None) -> bool:
        return saturates if option is None else option

    return Int8Recipe(
        form="s8s8" if backend == "tensorrt" else "u8s8",
        reduce_range=choose(options.reduce_range),
        keep_first_and_last=choose(options.keep_first_and_last),
        kernels=name,
        gate_fused=backend != "tensorrt",
    )
