"""Regenerates oip_pb2.py from oip.proto: `python -m cluster._oip_pb.generate` (needs grpcio-tools).

The module protoc writes is changed in one way: its descriptors go to a descriptor pool of
their own instead of protobuf's default pool. tritonclient registers the same `inference.*`
names in the default pool from its own .proto files, and two files defining one name in one
pool fail at import; with a pool of its own, the gateway and tritonclient live in one process.
Only the message classes are generated: the service is registered with
`grpc.method_handlers_generic_handler`, which needs no generated `_pb2_grpc` module (and so no
minimum grpcio version of the one that generated it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

__all__ = ["main"]

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = "oip.proto"
TARGET = "oip_pb2.py"
_DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile("
_OWN_POOL = "_POOL.AddSerializedFile("


def main() -> int:
    from importlib.metadata import version

    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{HERE}", f"--python_out={out}",
                        os.path.join(HERE, PROTO)], check=True)
        with open(os.path.join(out, TARGET), encoding="utf-8") as f:
            text = f.read()
    if text.count(_DEFAULT_POOL) != 1:
        raise SystemExit(f"protoc's {TARGET} does not add its file to the default pool once; update {__file__}")
    text = text.replace(_DEFAULT_POOL, _OWN_POOL).replace(
        "from google.protobuf.internal import builder as _builder\n",
        "from google.protobuf.internal import builder as _builder\n\n_POOL = _descriptor_pool.DescriptorPool()\n", 1)
    header = (f"# Generated from {PROTO} by grpcio-tools {version('grpcio-tools')} (protobuf "
              f"{version('protobuf')} runtime) with `python -m cluster._oip_pb.generate`;\n"
              "# the descriptors go to a pool of their own (see generate.py). Spec: Open Inference Protocol\n"
              "# gRPC v2 (open_inference_grpc.proto) with Triton's grpc_service.proto additions.\n")
    with open(os.path.join(HERE, TARGET), "w", encoding="utf-8") as f:
        f.write(header + text)
    print(f"wrote {os.path.join(HERE, TARGET)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
