"""ONNX to torch: the ONNX file converted op by op into a ``torch.nn.Module`` (``OnnxModule``).

Conv (any padding, groups, dilation), Relu, Clip, elementwise arithmetic, pooling,
Flatten/Reshape, Gemm/MatMul, Pad, Cast and a few more; an op outside that set is refused by
name (``UnsupportedModel``). Pure torch: it runs, and is tested, on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, numpy_helper

_ONNX_DTYPES: dict[int, torch.dtype] = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.DOUBLE: torch.float64,
    TensorProto.INT64: torch.int64,
    TensorProto.INT32: torch.int32,
    TensorProto.INT8: torch.int8,
    TensorProto.UINT8: torch.uint8,
    TensorProto.BOOL: torch.bool,
}


_ARITHMETIC: dict[str, Callable[[Any, Any], Any]] = {
    "Add": lambda x, y: x + y,
    "Sub": lambda x, y: x - y,
    "Mul": lambda x, y: x * y,
    "Div": lambda x, y: x / y,
}


def _same(x: Any, *_: Any) -> Any:
    """The first input itself: Identity, or an op whose attributes leave it nothing to do."""
    return x


# Ops whose result may share memory with their first input: ``reshape`` and ``permute``
# return views, and ``.to`` returns the tensor itself when it has the target dtype already
# (not known here: ``.to(dtype)`` may cast the module after conversion).
_VIEWS = frozenset({"Flatten", "Reshape", "Transpose", "Cast"})


def _add_into_first(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` written over ``x`` when the result has ``x``'s shape and dtype."""
    if x.dtype == y.dtype and x.shape == torch.broadcast_shapes(x.shape, y.shape):  # type: ignore[no-untyped-call]
        return x.add_(y)
    return x + y


_REDUCTIONS: dict[str, Callable[[torch.Tensor, tuple[int, ...], bool], torch.Tensor]] = {
    "ReduceMean": lambda x, dims, keep: x.mean(dim=dims, keepdim=keep),
    "ReduceSum": lambda x, dims, keep: x.sum(dim=dims, keepdim=keep),
    "ReduceMax": lambda x, dims, keep: x.amax(dim=dims, keepdim=keep),
    "ReduceMin": lambda x, dims, keep: x.amin(dim=dims, keepdim=keep),
}


class UnsupportedModel(ValueError):
    """The ONNX graph uses something the converter does not implement."""


@dataclass(frozen=True)
class _Step:
    op: str
    name: str
    fn: Callable[..., Any]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


class _Memory:
    """Which values share one tensor's memory, to tell when a step may overwrite its input.

    An elementwise op may write its result over its first input, as torchvision's
    ReLU(inplace=True) and ``out += identity`` do, instead of writing a fresh activation to
    memory. That is sound only for memory that a step of this module allocated (never the
    caller's input, nor a weight or a constant) and that nothing reads afterwards under any
    name: a view, a pass-through and an in-place result share their source's memory, so the
    reads are those of every name of that memory.
    """

    def __init__(self, nodes: Sequence[onnx.NodeProto], outputs: Sequence[str]) -> None:
        self._last_read: dict[str, int] = {}
        for index, node in enumerate(nodes):
            for name in node.input:
                if name:
                    self._last_read[name] = index
        for name in outputs:
            self._last_read[name] = len(nodes)  # the caller reads it after the last step
        # A step's output -> the output that allocated its memory (None: memory this module
        # does not own, a view of an input or of a weight); that output -> its every name.
        self._owner: dict[str, str | None] = {}
        self._names: dict[str, list[str]] = {}

    def writable(self, index: int, node: onnx.NodeProto) -> bool:
        """Whether ``node``, the graph's ``index``-th, may overwrite its first input."""
        owner = self._owner.get(node.input[0]) if node.input else None
        if owner is None:
            return False
        if sum(self._owner.get(name) == owner for name in node.input) > 1:
            return False  # the step reads that memory as another operand too
        return all(self._last_read.get(name, -1) <= index for name in self._names[owner])

    def record(self, node: onnx.NodeProto, shares_first: bool) -> None:
        """The outputs of ``node``: the first one in its first input's memory if it
        ``shares_first``, the others (and otherwise all) in memory of their own."""
        for position, name in enumerate(node.output):
            if not name:
                continue
            owner = self._owner.get(node.input[0]) if position == 0 and shares_first else name
            self._owner[name] = owner
            if owner is not None:
                self._names.setdefault(owner, []).append(name)


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _pads_2d(pads: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int], bool]:
    """ONNX ``[h_begin, w_begin, h_end, w_end]`` as (begins, ends, symmetric)."""
    hb, wb, he, we = pads
    return (hb, wb), (he, we), (hb, wb) == (he, we)


class OnnxModule(torch.nn.Module):
    """An ONNX graph run node by node. Initializers are buffers (so ``.to()`` moves and casts
    them); shape-like constants (Reshape shapes, Clip bounds, pads, axes) are read once at
    conversion and baked into the steps."""

    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__()
        graph = model.graph
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
        self._names: dict[str, str] = {}
        self._static: dict[str, np.ndarray] = {}
        for init in graph.initializer:
            self._add_constant(init.name, numpy_helper.to_array(init))
        initializers = {init.name for init in graph.initializer}
        self.input_names = [v.name for v in graph.input if v.name not in initializers]
        self.output_names = [v.name for v in graph.output]
        memory = _Memory(graph.node, self.output_names)
        self._steps: list[_Step] = []
        for index, node in enumerate(graph.node):
            if node.op_type == "Constant":
                value = onnx.helper.get_attribute_value(node.attribute[0])
                if not isinstance(value, onnx.TensorProto):
                    raise UnsupportedModel(f"Constant {node.name!r}: only tensor values")
                self._add_constant(node.output[0], numpy_helper.to_array(value))
                continue
            writable = memory.writable(index, node)
            fn = self._convert(node, opset, writable)
            # A step given its input to overwrite returns that memory, or fresh memory when it
            # has no use for it: either way nothing reads the old contents again.
            memory.record(node, writable or node.op_type in _VIEWS or fn is _same)
            inputs = tuple(n for n in node.input if n)
            self._steps.append(_Step(node.op_type, node.name, fn, inputs, tuple(node.output)))

    def _add_constant(self, name: str, value: np.ndarray) -> None:
        self._static[name] = value
        attr = f"const_{len(self._names)}"
        self._names[name] = attr
        self.register_buffer(attr, torch.from_numpy(np.array(value)), persistent=False)

    def _const(self, name: str) -> np.ndarray:
        if name not in self._static:
            raise UnsupportedModel(f"{name!r} must be a constant (initializer or Constant)")
        return self._static[name]

    def _tensor(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = getattr(self, self._names[name])
        return tensor

    def _convert(self, node: onnx.NodeProto, opset: int, inplace: bool) -> Callable[..., Any]:
        op, a, name = node.op_type, _attrs(node), node.name or node.output[0]
        inputs = [n for n in node.input]
        if op == "Conv":
            return self._conv(node, a)
        if op == "Relu":
            return F.relu_ if inplace else F.relu
        if op == "Clip":
            if opset >= 11:
                low = float(self._const(inputs[1])) if len(inputs) > 1 and inputs[1] else None
                high = float(self._const(inputs[2])) if len(inputs) > 2 and inputs[2] else None
            else:
                low, high = a.get("min"), a.get("max")
            if low is None and high is None:
                return _same
            if inplace:
                return lambda x, *_: x.clamp_(low, high)
            return lambda x, *_: torch.clamp(x, low, high)
        if op == "Add" and inplace:
            return _add_into_first
        if op in ("Add", "Sub", "Mul", "Div"):
            return _ARITHMETIC[op]
        if op == "Sigmoid":
            return torch.sigmoid
        if op == "Tanh":
            return torch.tanh
        if op == "HardSigmoid":
            alpha, beta = a.get("alpha", 0.2), a.get("beta", 0.5)
            return lambda x: torch.clamp(x * alpha + beta, 0.0, 1.0)
        if op == "HardSwish":
            return F.hardswish
        if op == "Identity":
            return _same
        if op == "GlobalAveragePool":
            return lambda x: x.mean(dim=tuple(range(2, x.dim())), keepdim=True)
        if op == "GlobalMaxPool":
            return lambda x: x.amax(dim=tuple(range(2, x.dim())), keepdim=True)
        if op in _REDUCTIONS:
            axes = a.get("axes")
            if axes is None and len(inputs) > 1 and inputs[1]:
                axes = [int(v) for v in self._const(inputs[1]).ravel()]
            keep = bool(a.get("keepdims", 1))
            reduce = _REDUCTIONS[op]
            if not axes:
                if a.get("noop_with_empty_axes", 0):
                    return _same
                return lambda x, *_: reduce(x, tuple(range(x.dim())), keep)
            dims = tuple(int(v) for v in axes)
            return lambda x, *_: reduce(x, dims, keep)
        if op == "Flatten":
            axis = int(a.get("axis", 1))

            return lambda x: x.reshape(math.prod(x.shape[:axis]), -1)
        if op == "Reshape":
            shape = [int(v) for v in self._const(inputs[1]).ravel()]

            def reshape(x: torch.Tensor, *_: Any) -> torch.Tensor:
                target = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
                return x.reshape(target)

            return reshape
        if op == "Gemm":
            return self._gemm(inputs, a)
        if op == "MatMul":
            return torch.matmul
        if op in ("MaxPool", "AveragePool"):
            return self._pool(op, a)
        if op == "Pad":
            mode = a.get("mode", b"constant")
            mode = mode.decode() if isinstance(mode, bytes) else mode
            if opset >= 11:
                pads = [int(v) for v in self._const(inputs[1]).ravel()]
                value = float(self._const(inputs[2])) if len(inputs) > 2 and inputs[2] else 0.0
            else:
                pads, value = list(a["pads"]), float(a.get("value", 0.0))
            half = len(pads) // 2
            # torch wants (last_begin, last_end, ..., first_begin, first_end).
            torch_pads = [p for i in reversed(range(half)) for p in (pads[i], pads[i + half])]
            while len(torch_pads) > 4 and torch_pads[-2:] == [0, 0]:
                torch_pads = torch_pads[:-2]
            torch_mode = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}[mode]
            if torch_mode == "constant":
                return lambda x, *_: F.pad(x, torch_pads, mode="constant", value=value)
            return lambda x, *_: F.pad(x, torch_pads, mode=torch_mode)
        if op == "Cast":
            dtype = _ONNX_DTYPES.get(int(a["to"]))
            if dtype is None:
                raise UnsupportedModel(f"Cast {name!r}: unsupported target type {a['to']}")
            return lambda x: x.to(dtype)
        if op == "Softmax":
            if opset >= 13:
                axis = int(a.get("axis", -1))
                return lambda x: torch.softmax(x, dim=axis)
            # Before opset 13 the input is seen as a matrix whose rows span every dimension
            # from axis on, and each row is normalised.
            start = int(a.get("axis", 1))
            return lambda x: torch.softmax(x.flatten(start), dim=-1).reshape(x.shape)
        if op == "BatchNormalization":
            eps = float(a.get("epsilon", 1e-5))
            return lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b, False, 0.0, eps)
        if op == "Concat":
            axis = int(a["axis"])
            return lambda *xs: torch.cat(xs, dim=axis)
        if op == "Transpose":
            if "perm" not in a:
                return lambda x: x.permute(tuple(reversed(range(x.dim()))))
            perm = tuple(int(p) for p in a["perm"])
            return lambda x: x.permute(perm)
        raise UnsupportedModel(
            f"ONNX op {op} (node {name!r}) is not supported by the torch backend; "
            f"serve this model with backend: onnxruntime"
        )

    def _conv(self, node: onnx.NodeProto, a: dict[str, Any]) -> Callable[..., Any]:
        name = node.name or node.output[0]
        weight = self._const(node.input[1])
        if weight.ndim != 4:
            raise UnsupportedModel(f"Conv {name!r}: only 2-D convolutions")
        if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
            raise UnsupportedModel(f"Conv {name!r}: auto_pad {a['auto_pad']!r}")
        stride = tuple(a.get("strides", (1, 1)))
        dilation = tuple(a.get("dilations", (1, 1)))
        groups = int(a.get("group", 1))
        begins, ends, symmetric = _pads_2d(a.get("pads", (0, 0, 0, 0)))
        if symmetric:

            def conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> Any:
                return F.conv2d(x, w, b, stride, begins, dilation, groups)

            return conv
        # TensorFlow-style SAME padding puts the extra row and column at the end, which
        # torch's symmetric ``padding`` cannot express: pad explicitly, then convolve.
        explicit = (begins[1], ends[1], begins[0], ends[0])

        def padded_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> Any:
            return F.conv2d(F.pad(x, explicit), w, b, stride, 0, dilation, groups)

        return padded_conv

    def _gemm(self, inputs: list[str], a: dict[str, Any]) -> Callable[..., Any]:
        alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
        trans_a, trans_b = bool(a.get("transA", 0)), bool(a.get("transB", 0))

        def gemm(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None = None) -> Any:
            x = x.t() if trans_a else x
            if alpha == 1.0 and beta == 1.0:
                return F.linear(x, w if trans_b else w.t(), c)
            y = alpha * (x @ (w.t() if trans_b else w))
            return y if c is None else y + beta * c

        return gemm

    def _pool(self, op: str, a: dict[str, Any]) -> Callable[..., Any]:
        kernel = tuple(a["kernel_shape"])
        if len(kernel) != 2:
            raise UnsupportedModel(f"{op}: only 2-D pooling")
        stride = tuple(a.get("strides", (1, 1)))
        ceil = bool(a.get("ceil_mode", 0))
        begins, ends, symmetric = _pads_2d(a.get("pads", (0, 0, 0, 0)))
        explicit = (begins[1], ends[1], begins[0], ends[0])
        if op == "MaxPool":
            dilation = tuple(a.get("dilations", (1, 1)))
            if symmetric:
                return lambda x: F.max_pool2d(x, kernel, stride, begins, dilation, ceil)
            return lambda x: F.max_pool2d(
                F.pad(x, explicit, value=float("-inf")), kernel, stride, 0, dilation, ceil
            )
        include = bool(a.get("count_include_pad", 0))
        if symmetric:
            return lambda x: F.avg_pool2d(x, kernel, stride, begins, ceil, include)
        if include:
            return lambda x: F.avg_pool2d(F.pad(x, explicit), kernel, stride, 0, ceil, True)

        # torch pads symmetrically only, so the zeros are explicit and counted: each window's
        # mean over the padded input, divided by the share of it that is input (the same
        # mean, over ones padded alike), is the mean over the input alone.
        def average_without_padding(x: torch.Tensor) -> torch.Tensor:
            ones = F.pad(x.new_ones((1, 1, *x.shape[2:])), explicit)
            share = F.avg_pool2d(ones, kernel, stride, 0, ceil, True)
            return F.avg_pool2d(F.pad(x, explicit), kernel, stride, 0, ceil, True) / share

        return average_without_padding

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values: dict[str, Any] = dict(zip(self.input_names, args, strict=True))
        for step in self._steps:
            result = step.fn(*(self._lookup(values, n) for n in step.inputs))
            if len(step.outputs) == 1:
                values[step.outputs[0]] = result
            else:
                values.update(zip(step.outputs, result, strict=False))
        return tuple(self._lookup(values, n) for n in self.output_names)

    def _lookup(self, values: dict[str, Any], name: str) -> Any:
        if name in values:
            return values[name]
        return self._tensor(name)


def convert(path: Path) -> OnnxModule:
    """The ONNX file as a module on the CPU, in the graph's own dtypes."""
    return OnnxModule(onnx.load(str(path))).eval()
