"""An MLServer custom runtime serving an ONNX file with ONNX Runtime on the CPU.

The MLServer side of ``scripts/mlserver_compare.sh``: the same ONNX file Stoker serves, run
the way an MLServer user would run it. Requests are decoded with MLServer's ``NumpyCodec``
(its standard decode), the batch MLServer's adaptive batcher formed runs in one
``session.run``, and the outputs go back encoded with ``NumpyCodec``.

It runs inside MLServer's own environment (``MLSERVER_VENV``, default ``/tmp/mlsenv``), never
in Stoker's: nothing in the project imports it, and mlserver is not a dependency of the
project. mypy sees ``mlserver`` as Any there (``ignore_missing_imports``), hence the one
ignore on the class.

Threads: ``intra_op_threads`` in the model settings' ``parameters.extra``, else the
``ORT_INTRA_OP_THREADS`` environment variable, else every core (``os.cpu_count()``), which is
what a user running one worker would pick. ``allow_spinning`` (extra, or
``ORT_ALLOW_SPINNING``: 0 or 1) is left to ONNX Runtime (on) unless given.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


def _setting(extra: dict[str, Any], key: str, env: str) -> str | None:
    value = extra.get(key)
    if value is None:
        value = os.environ.get(env) or None
    return None if value is None else str(value)


class OnnxRuntime(MLModel):  # type: ignore[misc]
    """ONNX Runtime on the CPU behind MLServer's V2 dataplane and adaptive batching."""

    async def load(self) -> bool:
        uri = await get_model_uri(self.settings, wellknown_filenames=["model.onnx"])
        parameters = self.settings.parameters
        extra: dict[str, Any] = dict((parameters.extra if parameters else None) or {})
        threads = _setting(extra, "intra_op_threads", "ORT_INTRA_OP_THREADS")
        spinning = _setting(extra, "allow_spinning", "ORT_ALLOW_SPINNING")
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(threads) if threads else os.cpu_count() or 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if spinning is not None:
            options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        self._session = ort.InferenceSession(
            uri, sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._output_names = [output.name for output in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds: dict[str, np.ndarray] = {
            request_input.name: self.decode(request_input, default_codec=NumpyCodec)
            for request_input in payload.inputs
        }
        values = self._session.run(self._output_names, feeds)
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            id=payload.id,
            outputs=[
                NumpyCodec.encode_output(name, value)
                for name, value in zip(self._output_names, values, strict=True)
            ],
        )
