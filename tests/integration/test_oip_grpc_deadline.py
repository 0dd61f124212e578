"""The OIP gRPC door takes the call's gRPC deadline as the request's deadline.

gRPC keeps deadlines in whole milliseconds and fires the client's timer late on loopback:
a 1 us deadline on an echo call over grpcio 1.85 was answered in 287 of 300 calls. So the
case is one the client's timer cannot decide: a model that runs about 0.2 s and a deadline
of half its run time. Only the gateway, seeing the deadline, refuses it at once with
RESOURCE_EXHAUSTED; a door that dropped it would run the model and the client would see
DEADLINE_EXCEEDED from its own timer.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from cluster._oip_pb import oip_pb2 as pb
from cluster.gateway import PoolKey
from tests.integration._oip_grpc_support import AUTH, oip_grpc_door
from tests.integration.test_gateway_overload import conv_stack

pytestmark = pytest.mark.grpc

_INFER = "/inference.GRPCInferenceService/ModelInfer"
SHAPE = (1, 8, 96, 96)
"""8 convolutions of 192 channels at this size: about 43 GFLOP a request."""


def _request(x: np.ndarray) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


def test_a_grpc_deadline_shorter_than_the_run_is_refused_at_once(tmp_path):
    with oip_grpc_door(str(tmp_path), model=conv_stack(n_layers=8, width=192, shape=SHAPE),
                       model_yaml="max_batch_size: 1\nintra_op_threads: 1\nfrontier: {default_cut_count: 1}\n") as door:
        with grpc.insecure_channel(door.host) as channel:
            infer = channel.unary_unary(_INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                        response_deserializer=pb.ModelInferResponse.FromString)
            x = np.ones(SHAPE, np.float32)
            md = tuple(AUTH.items())
            for _ in range(2):  # the pool learns its run time from these
                assert infer(_request(x), metadata=md, timeout=60).raw_output_contents
            whole = next(c for c in door.gateway.registry.resolve("m", "1").frontier.cuts if not c.edge_layers)
            pool = door.gateway._pools[PoolKey("m", "1", whole.cut_id)]
            run_s = pool.batcher.run_times.estimate_s(1)
            assert run_s is not None and run_s > 0.05, run_s

            with pytest.raises(grpc.RpcError) as e:
                infer(_request(x), metadata=md, timeout=run_s / 2)
            assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, (e.value.code(), e.value.details())
            assert "retry after" in e.value.details(), e.value.details()
            # The same request with time to run is answered.
            assert infer(_request(x), metadata=md, timeout=60).raw_output_contents
