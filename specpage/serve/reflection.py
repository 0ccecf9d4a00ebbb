"""gRPC server reflection under both names clients ask for: ``grpc.reflection.v1``
(grpcurl and current clients) and ``grpc.reflection.v1alpha`` (older ones).

grpcio-reflection ships only v1alpha. The v1 protocol is the same messages in
the package ``grpc.reflection.v1``, so it is served by the v1alpha servicer
with the v1alpha message classes, and its descriptor is derived from
v1alpha's by renaming the package: a client that asks for the v1 file or
symbol gets it.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"  # its path in the grpc repository
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"


def v1_descriptor() -> FileDescriptor:
    """The v1 reflection file, added to the default pool once."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # scalars have none; an empty one is invalid
                field.type_name = field.type_name.replace(old, f".{V1_PACKAGE}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(old, f".{V1_PACKAGE}.")
    # The options v1's own .proto sets; v1alpha's are marked deprecated.
    proto.options.Clear()
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    proto.options.java_multiple_files = True
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    pool.AddSerializedFile(proto.SerializeToString())
    return pool.FindFileByName(V1_FILE)


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection for service_names plus both reflection services."""
    v1_descriptor()  # so that the v1 file and symbols are found like any other
    servicer = reflection.aio.ReflectionServicer(
        (*service_names, V1_SERVICE, V1ALPHA_SERVICE))
    # Wire-identical messages: one handler body, registered under each name.
    for name in (V1_SERVICE, V1ALPHA_SERVICE):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),))
