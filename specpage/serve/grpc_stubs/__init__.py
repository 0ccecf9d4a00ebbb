"""Generated gRPC stubs of protos/specpage/v1 (make protos); do not edit."""
