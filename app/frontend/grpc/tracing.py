"""Each gRPC ``ModelInfer`` call, for ``app.tracing``: installed only where tracing is on
(``ModelStreamInfer`` traces each of its requests itself: ``InferenceService``).

The call's ``traceparent`` and ``tracestate`` metadata are what the data plane's trace of it
continues; its end (an error status where it failed) ends the trace. Its ``receive`` runs
from the call's start to the data plane's (the message read and parsed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from app import tracing
from app.frontend.grpc.service import SERVICE

if TYPE_CHECKING:
    from typing import TypeAlias

    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

TRACED = f"/{SERVICE}/ModelInfer"


class TraceCalls(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(details)
        if handler is None or details.method != TRACED or handler.response_streaming:
            return handler
        carrier = tracing.carried(details.invocation_metadata)
        # The limits take a unary call as a stream of one request (``limits.limited``).
        streamed = handler.request_streaming
        behaviour: Any = handler.stream_unary if streamed else handler.unary_unary

        async def traced(request: Any, context: Context) -> Any:
            incoming = tracing.Incoming(TRACED.removeprefix("/"), carrier)
            token = tracing.INCOMING.set(incoming)
            failed = None
            try:
                return await behaviour(request, context)
            except BaseException as error:
                failed = type(error).__name__
                raise
            finally:
                tracing.INCOMING.reset(token)
                incoming.finish(failed)

        wrap = (
            grpc.stream_unary_rpc_method_handler
            if streamed
            else grpc.unary_unary_rpc_method_handler
        )
        return wrap(traced, handler.request_deserializer, handler.response_serializer)
