"""Fuzzing the OIP REST door of a real gateway with malformed requests.

Every malformed request (bad JSON, wrong datatype, shape, data, byte lengths, headers,
parameters, paths, tokens) must get a 4xx with an {"error": "..."} body naming the problem;
the server must answer a good request afterwards, and the process's memory stay flat.

5,000 requests in five rounds of 1,000, over one kept-alive HTTP/1.1 connection as tritonclient
keeps its own (the client opens a new one where the door closes it: after a body it refused
unread). Hypothesis draws them five per example, which costs a third of drawing one per
example; the five are independent, so each is still one malformed request.
"""

from __future__ import annotations

import http.client
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.integration._oip_support import AUTH, oip_door
from tests.integration._rss import rss_bytes

pytestmark = [pytest.mark.grpc, pytest.mark.slow]

ROUNDS = 5
PER_ROUND = 1000
"""Requests per round; the first round warms the process up, the rest must not grow it."""
PER_EXAMPLE = 5
"""Requests drawn per hypothesis example."""
PAD_BYTES = 16 << 10
"""Each POST's body carries this much more (a JSON field or white space the door ignores), so a
server that kept each request's body would grow by PAD_BYTES x 4,000 = 62 MiB over the last four
rounds (65 MiB measured with the door's bodies kept in a list)."""
RSS_BOUND_BYTES = 8 << 20
"""Growth of the process's RSS (_rss_bytes) allowed from the end of the first round to the end of
the last: twice what the gateway, the client and hypothesis grow without a leak (3.8 MiB)."""
_GOOD_INPUT = {"name": "x", "shape": [1, 4, 5, 5], "datatype": "FP32"}
_PAD = "p" * PAD_BYTES
_DATATYPES = ["BOOL", "UINT8", "INT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "fp32", "", "FLOAT"]


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    with oip_door(str(tmp_path_factory.mktemp("oipfuzz"))) as d:
        yield d


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20)


def _request(inputs=None, **top) -> dict:
    return {"inputs": [dict(_GOOD_INPUT, data=[0.5] * 100)] if inputs is None else inputs, "pad": _PAD, **top}


@st.composite
def bad_tensor(draw) -> dict:
    """One input entry that is wrong in exactly one way the door must refuse."""
    t = dict(_GOOD_INPUT, data=[0.5] * 100)
    how = draw(st.sampled_from(["datatype", "shape", "count", "kind", "name", "drop", "json"]))
    if how == "datatype":
        t["datatype"] = draw(st.sampled_from([d for d in _DATATYPES if d != "FP32"]))
    elif how == "shape":
        t["shape"] = draw(st.one_of(
            st.lists(st.integers(1, 6), max_size=6).filter(lambda s: s[1:] != [4, 5, 5]),
            st.lists(st.integers(-5, -1), min_size=1, max_size=4),
            json_values.filter(lambda v: not isinstance(v, list))))
        t["data"] = [0.5] * 100
    elif how == "count":
        t["data"] = [0.5] * draw(st.integers(0, 200).filter(lambda n: n != 100))
    elif how == "kind":
        t["data"] = [0.5] * 99 + [draw(st.one_of(st.text(max_size=4), st.none(), st.lists(st.booleans(), max_size=2),
                                              st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)))]
    elif how == "name":
        t["name"] = draw(st.one_of(st.text(max_size=6).filter(lambda s: s != "x"), st.integers(), st.none()))
    elif how == "drop":
        del t[draw(st.sampled_from(["name", "shape", "datatype", "data"]))]
    else:
        return draw(json_values.filter(lambda v: not isinstance(v, dict)))
    return t


@st.composite
def malformed(draw) -> tuple[str, str, dict[str, str], bytes]:
    """(method, path, headers, body) of a request that is malformed in one way."""
    path = "/v2/models/m/infer"
    headers = dict(AUTH)
    kind = draw(st.sampled_from(["bytes", "json", "tensor", "binary", "header", "params", "outputs", "path", "token"]))
    if kind == "bytes":
        body = draw(st.binary(max_size=300)) + bytes(PAD_BYTES)  # NUL is never valid JSON
    elif kind == "json":
        body = json.dumps(draw(json_values.filter(lambda v: not (isinstance(v, dict) and "inputs" in v)))).encode()
        body += b" " * PAD_BYTES  # trailing white space keeps the JSON what it was
    elif kind == "tensor":
        body = json.dumps(_request([draw(bad_tensor())])).encode()
    elif kind == "binary":
        size = draw(st.integers(0, 800))
        extra = draw(st.integers(0, 800).filter(lambda n: not (size == 400 and n == 400)))
        head = json.dumps(_request([dict(_GOOD_INPUT, parameters={"binary_data_size": size})])).encode()
        headers["Inference-Header-Content-Length"] = str(len(head))
        body = head + bytes(extra)
    elif kind == "header":
        head = json.dumps(_request([dict(_GOOD_INPUT, parameters={"binary_data_size": 400})])).encode()
        body = head + bytes(400)
        headers["Inference-Header-Content-Length"] = draw(st.one_of(
            st.integers(-10**6, 10**9).filter(lambda n: n != len(head)).map(str),
            st.text(alphabet="0123456789abc -+.", max_size=12).filter(lambda s: s.strip() != str(len(head)))))
    elif kind == "params":
        body = json.dumps(_request(parameters=draw(st.one_of(
            json_values.filter(lambda v: not isinstance(v, dict)),
            st.fixed_dictionaries({"timeout": st.one_of(st.integers(max_value=-1), st.floats(allow_nan=False),
                                                       st.text(max_size=4), st.booleans())}))))).encode()
    elif kind == "outputs":
        body = json.dumps(_request(outputs=draw(st.one_of(
            json_values.filter(lambda v: not isinstance(v, list) and v is not None),
            st.lists(st.fixed_dictionaries({"name": st.text(max_size=5).filter(lambda s: s != "y")}), min_size=1,
                     max_size=3))))).encode()
    elif kind == "path":
        body = json.dumps(_request()).encode()
        segment = st.text(alphabet="abcxyz019._-%", min_size=1, max_size=8)
        path = "/v2/" + draw(st.sampled_from([
            "models/zz{0}/infer", "models/m/versions/{0}9/infer", "models/m.tail.{0}/infer", "{0}/models",
            "models/m/{0}", "models/m/versions", "health/{0}", "models/zz{0}/versions/1/ready"])).format(draw(segment))
    else:
        body = json.dumps(_request()).encode()
        headers["Authorization"] = draw(st.one_of(
            st.sampled_from(["", "Bearer ", "Basic abc"]),
            st.text(alphabet="abcdefXYZ0123456789-_.~+/=", max_size=40).map(lambda t: f"Bearer {t}")))
    return draw(st.sampled_from(["POST", "GET"])) if kind == "path" else "POST", path, headers, body


def _send(conn: http.client.HTTPConnection, method: str, path: str, headers: dict[str, str],
          body: bytes) -> tuple[int, bytes]:
    """One request on `conn`, which reconnects by itself after an answer that closed it."""
    conn.request(method, path, body=body if method == "POST" else None, headers=headers)
    r = conn.getresponse()
    return r.status, r.read()


def test_malformed_requests_get_a_4xx_with_an_error_body_and_the_server_stays_up(door):
    seen: dict[int, int] = {}
    rss: list[int] = []
    good = json.dumps(_request()).encode()
    conn = http.client.HTTPConnection(door.host, timeout=30)

    def fuzz_round(round_seed: int) -> None:
        @seed(round_seed)
        @settings(max_examples=PER_ROUND // PER_EXAMPLE, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(st.lists(malformed(), min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
        def some(reqs):
            for req in reqs:
                status, out = _send(conn, *req)
                assert 400 <= status < 500, (status, out, req)
                error = json.loads(out)["error"]
                assert isinstance(error, str) and error, (out, req)
                seen[status] = seen.get(status, 0) + 1

        some()

    try:
        assert _send(conn, "POST", "/v2/models/m/infer", dict(AUTH), good)[0] == 200
        for r in range(ROUNDS):
            fuzz_round(r + 1)
            rss.append(rss_bytes())
        status, out = _send(conn, "POST", "/v2/models/m/infer", dict(AUTH), good)
    finally:
        conn.close()
    assert sum(seen.values()) == ROUNDS * PER_ROUND, seen
    assert {400, 401, 404} <= set(seen), seen
    assert status == 200 and np.array(json.loads(out)["outputs"][0]["data"]).shape == (3,)
    # Statistics keep only names that resolve: client-sent names cannot grow them.
    assert {s["name"] for s in door.oip.stats.to_json(None, None)["model_stats"]} == {"m"}
    grew = rss[-1] - rss[0]
    assert grew < RSS_BOUND_BYTES, (f"RSS grew {grew >> 20} MiB from the first to the last round of {PER_ROUND} "
                                    f"requests (MiB after each round: {[r >> 20 for r in rss]}; {seen})")
