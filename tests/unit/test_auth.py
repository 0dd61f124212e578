"""Tokens, allow-lists, rate limits and credential files; secrets never reach a log or an error."""

from __future__ import annotations

import logging

import pytest

from cluster.auth import (
    ANONYMOUS,
    AuthConfigError,
    Authorizer,
    TokenBucket,
    TokenTable,
    load_channel_credentials,
    load_server_credentials,
)
from cluster.errors import PermissionDenied, ResourceExhausted, Unauthenticated

CAM_TOKEN = "cam-secret-0123456789abcdef"
OPS_TOKEN = "ops-secret-fedcba9876543210"

TOKENS_YAML = f"""
tokens:
  - name: camera
    token: {CAM_TOKEN}
    models: [resnet50]
    rate_limit_rps: 2
    burst: 2
  - name: ops
    token: {OPS_TOKEN}
"""


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def table(tmp_path) -> TokenTable:
    p = tmp_path / "tokens.yaml"
    p.write_text(TOKENS_YAML)
    return TokenTable.from_file(str(p))


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_tokens_file_loads_names_models_and_rates(table):
    assert len(table) == 2
    cam = table.lookup(CAM_TOKEN)
    assert cam is not None and cam.name == "camera" and cam.models == ("resnet50",) and cam.rate_limit_rps == 2.0
    ops = table.lookup(OPS_TOKEN)
    assert ops is not None and ops.models is None and ops.allows("anything")
    assert table.lookup("x" * 20) is None
    assert CAM_TOKEN not in repr(table) and CAM_TOKEN not in repr(cam)


def test_a_tokens_max_priority_caps_what_its_requests_claim():
    """[Note: priority claims] in cluster/auth.py."""
    table = TokenTable.from_dicts([{"name": "cam", "token": CAM_TOKEN, "max_priority": 0},
                                   {"name": "ops", "token": OPS_TOKEN}])
    auth = Authorizer(table)
    cam = auth.authorize(bearer(CAM_TOKEN), model="m")
    ops = auth.authorize(bearer(OPS_TOKEN), model="m")
    assert cam.max_priority == 0 and [cam.priority(p) for p in (0, 1, 3)] == [0, 0, 0]
    assert ops.max_priority is None and [ops.priority(p) for p in (0, 1, 3)] == [0, 1, 3]
    assert ANONYMOUS.priority(1) == 1  # auth off: claims stand


def test_no_token_wrong_token_and_wrong_scheme_are_unauthenticated(table):
    auth = Authorizer(table)
    with pytest.raises(Unauthenticated, match="no authorization metadata"):
        auth.authorize({}, model="resnet50")
    with pytest.raises(Unauthenticated, match="not known"):
        auth.authorize(bearer("wrong-token-0000000000"), model="resnet50")
    with pytest.raises(Unauthenticated, match="not a Bearer"):
        auth.authorize({"authorization": f"Basic {CAM_TOKEN}"}, model="resnet50")
    assert auth.rejected["unauthenticated"] == 3


def test_token_for_another_model_is_permission_denied(table):
    auth = Authorizer(table)
    assert auth.authorize(bearer(CAM_TOKEN), model="resnet50", device_id="d1").name == "camera"
    with pytest.raises(PermissionDenied, match="'camera' may not infer model 'vgg19'") as e:
        auth.authorize(bearer(CAM_TOKEN), model="vgg19")
    assert e.value.principal == "camera"
    assert auth.authorize(bearer(OPS_TOKEN), model="vgg19").name == "ops"


def test_rate_limit_is_a_token_bucket_per_device():
    clock = Clock()
    table = TokenTable.from_dicts([{"name": "cam", "token": CAM_TOKEN, "rate_limit_rps": 2, "burst": 2}])
    auth = Authorizer(table, clock=clock)
    md = bearer(CAM_TOKEN)
    auth.authorize(md, model="m", device_id="a")
    auth.authorize(md, model="m", device_id="a")
    with pytest.raises(ResourceExhausted, match="retry after 500 ms") as e:
        auth.authorize(md, model="m", device_id="a")
    assert e.value.retryable and e.value.limit == 2.0
    auth.authorize(md, model="m", device_id="b")  # another device has its own bucket
    clock.t += 0.5
    auth.authorize(md, model="m", device_id="a")
    assert auth.rejected["rate_limited"] == 1


def test_token_bucket_refills_up_to_burst():
    b = TokenBucket(rate=10.0, burst=3.0, now_s=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.1)
    assert b.take(100.0) == 0.0
    assert b.level == pytest.approx(2.0)  # refilled to the burst, not beyond


def test_auth_off_is_anonymous_with_an_optional_default_rate():
    clock = Clock()
    auth = Authorizer(None, default_rate_limit_rps=1.0, clock=clock)
    assert auth.authorize({}, model="m", device_id="d") is ANONYMOUS
    with pytest.raises(ResourceExhausted):
        auth.authorize({}, model="m", device_id="d")
    assert not auth.enabled


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("nothing: here\n", "no top-level 'tokens' list"),
        ("tokens: {name: a}\n", "must be a list"),
        (f"tokens: [{{token: {CAM_TOKEN}}}]\n", r"tokens\[0\].name is missing"),
        ("tokens: [{name: a, token: short}]\n", "shorter than 16 characters"),
        (f"tokens: [{{name: a, token: {CAM_TOKEN}}}, {{name: a, token: {OPS_TOKEN}}}]\n", "more than once"),
        (f"tokens: [{{name: a, token: {CAM_TOKEN}}}, {{name: b, token: {CAM_TOKEN}}}]\n", "share one token"),
        (f"tokens: [{{name: a, token: {CAM_TOKEN}, models: resnet50}}]\n", "models must be a list"),
        (f"tokens: [{{name: a, token: {CAM_TOKEN}, rate_limit_rps: -1}}]\n", "rate_limit_rps=-1 must be a positive"),
        (f"tokens: [{{name: a, token: {CAM_TOKEN}, scope: all}}]\n", r"unknown field\(s\) \['scope'\]"),
        (f"tokens: [{{name: a, token: {CAM_TOKEN}, max_priority: 4}}]\n", "max_priority=4 must be an integer 0-3"),
        (f"tokens: [{{name: a, token: {CAM_TOKEN}, max_priority: true}}]\n", "max_priority=True must be"),
        (f"tokens: [{{name: a, token: '{CAM_TOKEN}\n", "is not valid YAML"),
    ],
)
def test_bad_tokens_files_name_the_problem_and_never_the_secret(tmp_path, text, match):
    p = tmp_path / "tokens.yaml"
    p.write_text(text)
    with pytest.raises(AuthConfigError, match=match) as e:
        TokenTable.from_file(str(p))
    assert CAM_TOKEN not in str(e.value) and OPS_TOKEN not in str(e.value)
    assert "short" not in str(e.value).replace("shorter", "")


def test_log_output_never_contains_a_token(table, caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    auth = Authorizer(table, clock=Clock())
    p = tmp_path / "tokens.yaml"
    p.write_text(TOKENS_YAML)
    TokenTable.from_file(str(p))
    for md, model in ((bearer(CAM_TOKEN), "resnet50"), (bearer(CAM_TOKEN), "vgg19"), (bearer(OPS_TOKEN + "x"), "m"),
                      (bearer(CAM_TOKEN), "resnet50"), (bearer(CAM_TOKEN), "resnet50")):
        try:
            auth.authorize(md, model=model, device_id="d")
        except Exception as e:  # noqa: BLE001 - every outcome is logged by the caller too
            logging.getLogger("test").info("rejected: %s", e)
    assert caplog.records
    assert CAM_TOKEN not in caplog.text and OPS_TOKEN not in caplog.text


def test_credential_files_are_checked(tmp_path):
    with pytest.raises(AuthConfigError, match="cannot read the certificate"):
        load_server_credentials(str(tmp_path / "none.crt"), str(tmp_path / "none.key"))
    bad = tmp_path / "bad.crt"
    bad.write_text("hello")
    with pytest.raises(AuthConfigError, match="is not PEM"):
        load_server_credentials(str(bad), str(bad))
    empty = tmp_path / "empty.crt"
    empty.write_text("")
    with pytest.raises(AuthConfigError, match="is empty"):
        load_channel_credentials(str(empty))
    with pytest.raises(AuthConfigError, match="needs its key"):
        load_channel_credentials(None, cert_file=str(bad))
