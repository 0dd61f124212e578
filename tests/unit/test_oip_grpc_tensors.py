"""The OIP gRPC door's tensor converters: raw and typed contents in, raw contents out, each refusal."""

from __future__ import annotations

import numpy as np
import pytest

from cluster._oip_grpc_tensors import CONTENTS_FIELD, decode_inputs, encode_outputs, parameter
from cluster._oip_pb import oip_pb2 as pb
from cluster._oip_tensors import DTYPE_OF
from cluster.errors import ProtocolError
from cluster.protocol.status import status_of


def request(datatype: str = "FP32", shape=(2, 3)) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype=datatype, shape=list(shape))
    return req


def refused(req: pb.ModelInferRequest, words: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode_inputs(req)
    assert status_of(e.value).name == "INVALID_ARGUMENT" and words in str(e.value), e.value


def test_raw_contents_decode_without_a_copy():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    req = request()
    req.raw_input_contents.append(x.tobytes())
    [got] = decode_inputs(req)
    assert got.name == "x" and np.array_equal(got.array, x) and not got.array.flags.owndata


@pytest.mark.parametrize("datatype", sorted(CONTENTS_FIELD))
def test_typed_contents_decode_for_every_datatype_that_has_a_field(datatype):
    dtype = DTYPE_OF[datatype]
    values = [True, False, True, False, True, False] if datatype == "BOOL" else [0, 1, 2, 3, 4, 5]
    req = request(datatype)
    getattr(req.inputs[0].contents, CONTENTS_FIELD[datatype]).extend(values)
    [got] = decode_inputs(req)
    assert got.array.dtype == dtype and got.array.tolist() == np.asarray(values, dtype).reshape(2, 3).tolist()


def test_each_refusal_names_the_value_and_the_fix():
    refused(pb.ModelInferRequest(model_name="m"), "has no inputs")
    refused(request("BYTES"), "has datatype 'BYTES'; use one of BOOL")
    short = request()
    short.raw_input_contents.append(b"\0" * 20)
    refused(short, "has 20 raw bytes but shape [2, 3] of FP32 is 24 bytes")
    extra = request()
    extra.raw_input_contents.extend([b"\0" * 24, b""])
    refused(extra, "2 raw_input_contents for 1 inputs")
    mixed = request()
    mixed.raw_input_contents.append(b"\0" * 24)
    mixed.inputs[0].contents.fp32_contents.append(1.0)
    refused(mixed, "use one or the other")
    few = request()
    few.inputs[0].contents.fp32_contents.extend([1.0] * 5)
    refused(few, "has 5 values in contents.fp32_contents but shape [2, 3] needs 6")
    wide = request("UINT8", (1,))
    wide.inputs[0].contents.uint_contents.append(256)
    refused(wide, "outside UINT8's range [0, 255]")
    refused(request("FP16", (1,)), "FP16, which travels only as raw_input_contents")
    refused(request(shape=(-1, 3)), "has shape [-1, 3]")
    refused(request(shape=(1,) * 17), "at most 16")


def test_outputs_leave_raw_in_the_requested_order():
    outputs = {"a": np.arange(3, dtype=np.int64), "b": np.ones((1, 2), np.float32)}
    resp = pb.ModelInferResponse()
    encode_outputs(resp, ["b", "a"], outputs)
    assert [(o.name, o.datatype, list(o.shape)) for o in resp.outputs] == [("b", "FP32", [1, 2]), ("a", "INT64", [3])]
    assert np.array_equal(np.frombuffer(resp.raw_output_contents[1], "<i8"), outputs["a"])
    every = pb.ModelInferResponse()
    encode_outputs(every, [], outputs)
    assert [o.name for o in every.outputs] == ["a", "b"]
    with pytest.raises(ProtocolError, match="asks for output 'c'; this model's outputs are"):
        encode_outputs(pb.ModelInferResponse(), ["c"], outputs)


def test_parameter_reads_whichever_value_is_set():
    req = pb.ModelInferRequest()
    req.parameters["timeout"].int64_param = 5
    req.parameters["device_id"].string_param = "d1"
    req.parameters["empty"].SetInParent()
    assert parameter(req.parameters, "timeout") == 5 and parameter(req.parameters, "device_id") == "d1"
    assert parameter(req.parameters, "empty") is None and parameter(req.parameters, "absent") is None
