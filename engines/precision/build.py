"""From a model's FP32 ONNX to the artefact each (precision, backend) serves, via the store.

A precision is a property of the ONNX graph: ``fp16`` is a float16 graph that keeps the
sensitive ops in FP32, ``int8`` a graph with explicit Q/DQ nodes calibrated on real data
(U8S8 for ONNX Runtime's CPU kernels, symmetric S8S8 for TensorRT). Each variant is measured
against FP32 when it is built; one that misses its accuracy budget is refused, not served.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from engines.devices import cpu
from engines.precision import accuracy, calibration, fp16, int8, rows
from engines.precision.options import (
    FP16_TOLERANCE,
    Budget,
    Fp16Options,
    Int8Options,
    Int8Recipe,
    int8_recipe,
)
from engines.preprocess import ImagePreprocess
from engines.store import EngineKey, EngineStore, StoredEngine, sha256_file

log = logging.getLogger(__name__)


# Bumped when what calibration records changes (2: per-channel input means for bias
# correction), so ranges cached by an older build are recalibrated rather than reused.
RANGES_VERSION = 2


# Bumped when the code that makes or measures a variant changes what it builds (3: the INT8
# recipe follows the CPU's integer kernels; 4: fp16 checked on its own few rows, every output
# compared), so stored variants and their accuracy reports, refusals included, are rebuilt
# rather than trusted.
VARIANTS_VERSION = 4


@dataclass(frozen=True)
class BuildPlan:
    """What ``ensure_variant`` needs to know about one model, independent of the service."""

    model: str
    source: Path
    folder: Path
    input_name: str
    preprocess: ImagePreprocess | None
    profile: tuple[int, ...]
    fp16: Fp16Options = field(default_factory=Fp16Options)
    int8: Int8Options = field(default_factory=Int8Options)
    budgets: Mapping[str, Budget] = field(default_factory=dict)
    evaluation_samples: int = 200
    override_accuracy: bool = False


class AccuracyBudgetExceeded(Exception):
    """A variant lost more of FP32's answers than the model's budget allows."""


class BuildCancelled(Exception):
    """A build stopped because its caller asked (a server shutting down): nothing is stored."""


Cancelled = Callable[[], bool]


def never() -> bool:
    return False


def backend_identity(backend: str) -> tuple[str, str]:
    """(ONNX Runtime's version, device) for a variant's store key. ONNX Runtime's variants
    name the CPU's integer kernels, which decide an INT8 variant's numbers and speed; the
    others (a TensorRT variant is gated with its Q/DQ graph in float) only the architecture,
    so a store built on one x86 CPU serves every other."""
    if backend == "onnxruntime":
        return ort.__version__, f"cpu-{cpu.integer_kernels().name}"
    return ort.__version__, f"cpu-{platform.machine()}"


def variant_rows(plan: BuildPlan) -> rows.VariantRows:
    """The rows ``plan``'s variants are calibrated and checked on, loaded as they are used."""
    return rows.VariantRows(
        plan.model, plan.source, plan.folder, plan.preprocess, plan.int8, plan.evaluation_samples
    )


def evaluate(
    plan: BuildPlan,
    precision: str,
    reference: onnx.ModelProto,
    candidate: onnx.ModelProto,
    data: rows.CheckRows,
    *,
    integer_kernels: bool = True,
) -> dict[str, float]:
    """A variant against FP32 on ``data``: the largest relative error of any output and, for
    a model with preprocessing (a classifier) or an INT8 variant, the top-1 agreement and
    mean softmax KL of the first output. The fp16 variant of a model without preprocessing is
    judged by the error alone: its outputs are not known to be class scores.

    With ``integer_kernels`` the variant runs as ONNX Runtime serves it (Q/DQ fused into
    this CPU's integer kernels); without, its Q/DQ nodes run as written, in float, which is
    what a GPU's INT8 arithmetic computes and what no CPU's int16 saturation can distort.
    """
    want = accuracy.run_outputs(reference, data.runs())
    got = accuracy.run_outputs(candidate, data.runs(), optimize=integer_kernels)
    report = {"max_relative_error": accuracy.max_relative_error(want, got)}
    if plan.preprocess is not None or precision == "int8":
        report["top1_agreement"] = accuracy.top1_agreement(want[0], got[0])
        report["mean_kl"] = accuracy.mean_kl(want[0], got[0])
    report["samples"] = float(data.samples)
    return report


def tolerance(plan: BuildPlan, precision: str, budget: Budget | None) -> float | None:
    """The largest relative error a variant may have: the budget's, else FP16's own for
    the fp16 variant of a model without preprocessing; None: not checked."""
    if budget is not None and budget.max_relative_error is not None:
        return budget.max_relative_error
    return FP16_TOLERANCE if precision == "fp16" and plan.preprocess is None else None


def budget_problems(plan: BuildPlan, precision: str, report: Mapping[str, float]) -> list[str]:
    """How a variant's accuracy report misses the model's budget (empty when it does not)."""
    budget = plan.budgets.get(precision)
    problems = []
    agreement = report.get("top1_agreement")
    if budget is not None and agreement is not None and agreement < budget.min_top1_agreement:
        short = (budget.min_top1_agreement - agreement) * 100
        problems.append(
            f"top-1 agreement with fp32 {agreement:.4f} < {budget.min_top1_agreement} "
            f"(short by {short:.2f} points)"
        )
    kl, kl_limit = report.get("mean_kl"), budget.max_mean_kl if budget is not None else None
    if kl is not None and kl_limit is not None and kl > kl_limit:
        problems.append(f"mean KL {kl:.4f} > {kl_limit}")
    error, allowed = report.get("max_relative_error"), tolerance(plan, precision, budget)
    if error is not None and allowed is not None and not error <= allowed:
        problems.append(f"largest error relative to the output's scale {error:.3g} > {allowed:g}")
    return problems


def check_budget(plan: BuildPlan, precision: str, report: Mapping[str, float]) -> None:
    problems = budget_problems(plan, precision, report)
    if not problems:
        return
    advice = (
        "try another calibrator (int8.calibrator: auto, entropy, percentile, minmax), more "
        "samples (int8.samples), a real calibration set (int8.calibration: <folder>), or "
        "keeping sensitive nodes out (int8.exclude_nodes / exclude_op_types)"
        if precision == "int8"
        else "keep more ops in fp32 (fp16.keep_fp32_ops, keep_fp32_nodes, keep_first_and_last), "
        "or allow more (accuracy.budgets.fp16.max_relative_error)"
    )
    message = (
        f"{plan.model} {precision} misses its accuracy budget on "
        f"{int(report['samples'])} samples: {'; '.join(problems)}. To fix: {advice}; "
        f"or set accuracy.override: true to serve it anyway."
    )
    if plan.override_accuracy:
        log.warning("%s (served anyway: accuracy.override is set)", message)
        return
    raise AccuracyBudgetExceeded(message)


def calibration_ranges(
    store: EngineStore,
    plan: BuildPlan,
    model_hash: str,
    recipe: Int8Recipe,
    data: rows.VariantRows,
    cancelled: Cancelled = never,
) -> calibration.Ranges:
    """The activation ranges for the INT8 variant, cached in the store so a rebuild (another
    backend, a bumped runtime) does not recalibrate."""
    options = plan.int8
    key = EngineKey(
        model=plan.model,
        model_hash=model_hash,
        precision="int8",
        backend="any",
        backend_version="",
        device="",
        options={
            "ranges_version": RANGES_VERSION,
            "calibrator": options.calibrator,
            "percentile": options.percentile,
            "samples": options.samples,
            "evaluation_samples": plan.evaluation_samples,
            "data": data.fingerprint,
            # Ranges do not depend on the INT8 recipe, except when auto scores candidates in it.
            "recipe": asdict(recipe) if options.calibrator == "auto" else "any",
        },
        kind="calibration",
    )

    def calibrate(path: Path) -> dict[str, Any]:
        calibration_rows, _ = data.split()
        model = onnx.load(str(plan.source))
        started = time.perf_counter()

        def progress(done: int, total: int) -> None:
            if cancelled():
                log.info(
                    "%s: calibration stopped at %d/%d rows (shutting down)", plan.model, done, total
                )
                raise BuildCancelled(f"{plan.model}: calibration stopped at {done}/{total} rows")
            log.info("%s: calibrating (%s) %d/%d rows", plan.model, options.calibrator, done, total)

        extra: dict[str, Any] = {}
        if options.calibrator == "auto":
            ranges, scores = int8.calibrate_auto(
                model,
                calibration_rows,
                plan.input_name,
                recipe.form,
                exclude_op_types=options.exclude_op_types,
                exclude_nodes=options.exclude_nodes,
                reduce_range=recipe.reduce_range,
                keep_first_and_last=recipe.keep_first_and_last,
                integer_kernels=recipe.gate_fused,
                progress=progress,
            )
            extra["auto_mean_kl"] = scores
        else:
            ranges = calibration.collect_ranges(
                model,
                calibration_rows,
                plan.input_name,
                options.calibrator,
                percentile=options.percentile,
                progress=progress,
            )
        extra["seconds"] = round(time.perf_counter() - started, 1)
        extra["method"] = ranges.method
        path.write_text(ranges.to_json())
        log.info("%s: calibrated with %s in %.1f s", plan.model, ranges.method, extra["seconds"])
        return extra

    stored = store.get_or_build(key, calibrate, ".json")
    return calibration.Ranges.from_json(stored.path.read_text())


def make_variant(
    store: EngineStore,
    plan: BuildPlan,
    precision: str,
    recipe: Int8Recipe,
    model_hash: str,
    data: rows.VariantRows,
    cancelled: Cancelled = never,
) -> onnx.ModelProto:
    model = onnx.load(str(plan.source))
    if precision == "fp16":
        options = plan.fp16
        return fp16.to_fp16(
            model,
            keep_fp32_ops=(
                fp16.DEFAULT_FP32_OPS if options.keep_fp32_ops is None else options.keep_fp32_ops
            ),
            keep_fp32_nodes=options.keep_fp32_nodes,
            keep_first_and_last=options.keep_first_and_last,
        )
    if precision == "int8":
        ranges = calibration_ranges(store, plan, model_hash, recipe, data, cancelled)
        return int8.to_int8(
            model,
            ranges,
            form=recipe.form,
            exclude_op_types=plan.int8.exclude_op_types,
            exclude_nodes=plan.int8.exclude_nodes,
            reduce_range=recipe.reduce_range,
            keep_first_and_last=recipe.keep_first_and_last,
        )
    raise ValueError(f"no ONNX variant for precision {precision!r}")


def variant_key(
    plan: BuildPlan,
    precision: str,
    backend: str,
    recipe: Int8Recipe | None = None,
    data: rows.VariantRows | None = None,
) -> EngineKey:
    """The store key of a precision variant: everything that changes its numbers or speed
    (the model, the build options and calibration data, the recipe and the CPU's integer
    kernels it was chosen for, ONNX Runtime's version, this code's ``VARIANTS_VERSION``).
    ``recipe`` and ``data`` where the caller has them already (the data's fingerprint reads
    every file of a calibration folder)."""
    recipe = recipe or int8_recipe(backend, plan.int8)
    data = data or variant_rows(plan)
    backend_version, device = backend_identity(backend)
    options: dict[str, Any] = {
        "variants_version": VARIANTS_VERSION,
        "form": recipe.form,
        "evaluation_samples": plan.evaluation_samples,
        "data": data.fingerprint,
    }
    if precision == "fp16":
        options["fp16"] = plan.fp16.model_dump(mode="json")
    elif precision == "int8":
        options["int8"] = plan.int8.model_dump(mode="json")
        options["recipe"] = asdict(recipe)
    return EngineKey(
        model=plan.model,
        model_hash=sha256_file(plan.source),
        precision=precision,
        backend=backend,
        backend_version=backend_version,
        device=device,
        profile=plan.profile,
        options=options,
    )


def ensure_variant(
    store: EngineStore,
    plan: BuildPlan,
    precision: str,
    backend: str,
    cancelled: Cancelled = never,
) -> tuple[Path, dict[str, Any]]:
    """The ONNX file that serves ``precision`` on ``backend`` and its accuracy report: the
    source for fp32, else a stored variant, built (calibrated, measured, gated) if missing.

    Raises ``AccuracyBudgetExceeded`` for a variant that misses its budget, and
    ``BuildCancelled`` as soon as ``cancelled()`` turns true during a calibration (checked
    every few rows; the store keeps nothing of it)."""
    if precision == "fp32":
        return plan.source, {}
    recipe = int8_recipe(backend, plan.int8)
    data = variant_rows(plan)
    key = variant_key(plan, precision, backend, recipe, data)

    def build(path: Path) -> dict[str, Any]:
        started = time.perf_counter()
        how = f" ({recipe.describe()})" if precision == "int8" else ""
        log.info("%s: building the %s variant for %s%s", plan.model, precision, backend, how)
        variant = make_variant(store, plan, precision, recipe, key.model_hash, data, cancelled)
        if cancelled():
            raise BuildCancelled(f"{plan.model}: the {precision} build stopped")
        onnx.save(variant, str(path))
        reference = onnx.load(str(plan.source))
        # FP16 needs no calibration: its check reads only the rows it runs.
        check = data.held_out() if precision == "int8" else data.check_rows()
        report = evaluate(
            plan, precision, reference, variant, check, integer_kernels=recipe.gate_fused
        )
        log.info(
            "%s %s: %s on %d rows (built in %.1f s)",
            plan.model,
            precision,
            describe(report),
            int(report["samples"]),
            time.perf_counter() - started,
        )
        extra: dict[str, Any] = {"accuracy": report}
        if precision == "int8":
            extra["recipe"] = asdict(recipe)
        return extra

    stored: StoredEngine = store.get_or_build(key, build, ".onnx")
    report: dict[str, Any] = stored.extra.get("accuracy", {})
    # The gate is policy, checked on every load against the report measured at build time:
    # a refused variant stays stored (a fixed budget or an override needs no rebuild) but is
    # never served against its budget.
    check_budget(plan, precision, report)
    return stored.path, report


def describe(report: Mapping[str, float]) -> str:
    """A variant's accuracy report, as the build's log line says it."""
    said = []
    if "top1_agreement" in report:
        said.append(f"top-1 agreement {report['top1_agreement']:.4f}")
    if "mean_kl" in report:
        said.append(f"mean KL {report['mean_kl']:.5f}")
    said.append(f"largest relative error {report['max_relative_error']:.2g}")
    return ", ".join(said)


def variant_state(store: EngineStore, plan: BuildPlan, precision: str, backend: str) -> str:
    """What the store holds for a variant, without building it: ``source`` (fp32), ``built``,
    ``refused: <why>`` (built, and misses its budget) or ``not built``."""
    if precision == "fp32":
        return "source"
    stored = store.load(variant_key(plan, precision, backend), ".onnx")
    if stored is None:
        return "not built"
    try:
        check_budget(plan, precision, stored.extra.get("accuracy", {}))
    except AccuracyBudgetExceeded as refusal:
        return f"refused: {refusal}"
    return "built"
