"""The KServe V2 / Triton gRPC API: ``codec`` (messages to and from what the data plane takes
and gives), ``service`` (the servicers, one more caller of the data plane), ``server`` (the
grpc.aio server, its keys and limits) and ``generated`` (protoc's output, checked in)."""
