"""The Open Inference Protocol's gRPC messages: oip.proto and the oip_pb2 module generated from it."""
