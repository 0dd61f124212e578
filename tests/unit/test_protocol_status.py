"""The error classes and the one status table, both ways."""

from __future__ import annotations

import logging

import grpc
import msgpack
import pytest

import cluster.errors
from cluster.protocol import errors as E
from cluster.protocol import status as S

#: One instance of every error class with its fields, and the code it must map to.
CASES = [
    (E.ProtocolError(reason="bad dtype code 99", where="InferRequest"), grpc.StatusCode.INVALID_ARGUMENT, "99"),
    (E.InvalidArgument(field="uplink", reason="-5 must be >= 1 bits/s"), grpc.StatusCode.INVALID_ARGUMENT, "uplink"),
    (E.EncodingError(reason="NaN in int8", fix="use fp32"), grpc.StatusCode.INVALID_ARGUMENT, "use fp32"),
    (E.VersionMismatch(got=[2, 1], supported=[1]), grpc.StatusCode.FAILED_PRECONDITION, "2.1"),
    (E.UnknownModelError(model="resnet", known=["vgg"]), grpc.StatusCode.NOT_FOUND, "'resnet'"),
    (E.UnknownVersionError(model="vgg", version="9", known=["1", "2"]), grpc.StatusCode.NOT_FOUND, "'9'"),
    (E.UnknownCutError(model="vgg", version="1", cut_id="c9", known=["c1"]), grpc.StatusCode.NOT_FOUND, "'c9'"),
    (E.DeadlineExceeded(where="in the queue", overdue_ms=12.5), grpc.StatusCode.DEADLINE_EXCEEDED, "12.5 ms"),
    (E.Unauthenticated(reason="no token"), grpc.StatusCode.UNAUTHENTICATED, "Bearer"),
    (E.PermissionDenied(principal="dev-7", action="infer vgg"), grpc.StatusCode.PERMISSION_DENIED, "dev-7"),
    (E.ResourceExhausted(resource="queue of vgg@1", limit=64, retry_after_ms=50), grpc.StatusCode.RESOURCE_EXHAUSTED, "64"),
    (E.Unavailable(reason="no workers"), grpc.StatusCode.UNAVAILABLE, "no workers"),
    (E.NotSupported(what="Plan"), grpc.StatusCode.UNIMPLEMENTED, "Plan"),
    (E.FailedPrecondition(reason="m@1 keeps no cloud profile", fix="add profiles/cloud.json"),
     grpc.StatusCode.FAILED_PRECONDITION, "profiles/cloud.json"),
    (E.InternalError(detail="boom"), grpc.StatusCode.INTERNAL, "boom"),
]


def test_every_error_class_has_a_case_and_a_status():
    classes = {getattr(E, n) for n in E.__all__} - {E.ClusterError}
    assert classes == {type(e) for e, _, _ in CASES} == set(S.STATUS_OF)


@pytest.mark.parametrize("err, code, needle", CASES, ids=lambda x: type(x).__name__ if isinstance(x, Exception) else "")
def test_each_error_maps_to_its_code_and_back(err, code, needle):
    assert isinstance(err, E.ClusterError) and str(err) == err.message and needle in err.message
    assert S.status_of(err) == code
    got_code, message, name, fields = S.to_status(err)
    assert (got_code, message, name) == (code, err.message, type(err).__name__)
    md = S.trailing_metadata(name, fields)
    back = S.from_status(code, message, md)
    assert type(back) is type(err) and back.message == err.message and back.fields() == err.fields()
    # A bare status (made by gRPC itself, or by a server that names no class) gives the code's default.
    bare = S.from_status(code, "details", None)
    assert isinstance(bare, S.CLASS_OF_STATUS[code]) and bare.message == "details"


def test_retryable_errors():
    assert {c for c in S.STATUS_OF if c.retryable} == {E.ResourceExhausted, E.Unavailable}


def test_subclass_outside_the_table_uses_its_parents_code_without_fields():
    class QueueFull(E.ResourceExhausted):
        def __init__(self) -> None:
            super().__init__(resource="queue", limit=3)

    code, message, name, fields = S.to_status(QueueFull())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and name == "ResourceExhausted" and fields == {}
    back = S.from_status(code, message, S.trailing_metadata(name, fields))
    assert isinstance(back, E.ResourceExhausted) and back.message == message


def test_unknown_exceptions_become_internal_with_a_generic_message_and_a_log(caplog):
    with caplog.at_level(logging.ERROR, logger="cluster.protocol.status"):
        code, message, name, _ = S.to_status(KeyError("secret detail"), where="Infer")
    assert code == grpc.StatusCode.INTERNAL and message == "internal error" and "secret" not in message
    assert name == "InternalError"
    assert "secret detail" in caplog.text and "Infer" in caplog.text


def test_unmatched_or_broken_metadata_falls_back_to_the_code():
    # The named class disagrees with the code: trust the code.
    e = S.from_status(grpc.StatusCode.NOT_FOUND, "m", [(S.ERROR_KEY, "Unauthenticated"), (S.FIELDS_KEY, msgpack.packb({}))])
    assert type(e) is E.UnknownModelError and e.message == "m"
    # Fields that do not fit the class.
    e = S.from_status(grpc.StatusCode.NOT_FOUND, "m", [(S.ERROR_KEY, b"UnknownModelError"), (S.FIELDS_KEY, msgpack.packb({"x": 1}))])
    assert type(e) is E.UnknownModelError and e.message == "m"
    e = S.from_status(grpc.StatusCode.NOT_FOUND, "m", [(S.ERROR_KEY, "UnknownModelError"), (S.FIELDS_KEY, b"\xc1")])
    assert type(e) is E.UnknownModelError
    e = S.from_status(grpc.StatusCode.DATA_LOSS, "", [])
    assert type(e) is E.InternalError and e.message == "DATA_LOSS"


def test_unpackable_fields_are_sent_as_text():
    err = E.ResourceExhausted(resource="q", limit=3)
    err.limit = object()  # type: ignore[assignment]
    _, _, _, fields = S.to_status(err)
    assert isinstance(fields["limit"], str)


def test_code_numbers_round_trip():
    for code in grpc.StatusCode:
        assert S.code_of_number(S.code_number(code)) == code
    assert S.code_of_number(999) == grpc.StatusCode.UNKNOWN


def test_long_name_lists_are_shortened():
    err = E.UnknownModelError(model="x", known=[f"m{i}" for i in range(20)])
    assert "and 12 more" in err.message
    assert "serves none" in E.UnknownModelError(model="x").message


def test_cluster_errors_are_the_wire_errors_defined_once():
    assert cluster.errors.__all__ == E.__all__
    for name in E.__all__:
        assert getattr(cluster.errors, name) is getattr(E, name), name
    assert {c.__name__ for c in S.STATUS_OF} == set(E.__all__) - {"ClusterError"}
