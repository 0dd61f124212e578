"""`Plan` on the gateway within model.yaml's accuracy budget, over real gRPC on 127.0.0.1:
model.yaml's min_agreement applies when the query names none, and the stricter of the two
applies when both do; the plan and frontier keep to the version's accuracy.json."""

from __future__ import annotations

import asyncio
import json
import os

import onnx
import pytest

from cluster.errors import InvalidArgument
from cluster.gateway import Gateway, LocalPoolFactory
from cluster.protocol.client import SyncInferenceClient
from cluster.protocol.encoding import encode
from cluster.registry import Registry
from cluster.server import serve_in_thread
from partitioner import Cut, build_graph
from planner import Encoding, make_flops_profile
from planner.accuracy import AccuracyEntry, AccuracyTable
from tests.integration.test_gateway_lossy import frame, image_model

pytestmark = pytest.mark.grpc

L = Cut(frozenset()).key
YAML = "frontier: {up_lo_bps: 50000, up_hi_bps: 100000000, rtt_ms: 5}\n"


def make_repo(root) -> str:
    """img@1: model.yaml sets min_agreement 0.99; img@2: the same files without a budget. Both
    keep an accuracy.json measuring the frame as jpeg@90 (0.995) and jpeg@10 (0.95)."""
    x = frame()
    entries = tuple(AccuracyEntry(L, f"jpeg@{q}", a, "y", "rel_l2", 4, float(encode(x, precision="jpeg", level=q)
                                                                                .wire_bytes), 0.01)
                    for q, a in ((90, 0.995), (10, 0.95)))
    for v, budget in (("1", "min_agreement: 0.99\n"), ("2", "")):
        d = os.path.join(root, "img", v)
        os.makedirs(os.path.join(d, "profiles"))
        path = os.path.join(d, "model.onnx")
        onnx.save(image_model(), path)
        with open(os.path.join(d, "model.yaml"), "w") as fh:
            fh.write(YAML + budget)
        g = build_graph(path)
        for name, gflops in (("device.json", 0.05), ("cloud.json", 50.0)):
            with open(os.path.join(d, "profiles", name), "w") as fh:
                json.dump(make_flops_profile(g, device=name[:-5], gflops=gflops, fixed_ms=0.2).to_dict(), fh)
        with open(os.path.join(d, "accuracy.json"), "w") as fh:
            fh.write(AccuracyTable("img", "f", 4, entries).to_json())
    return str(root)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    registry = Registry(make_repo(tmp_path_factory.mktemp("repo")), cache_dir=str(tmp_path_factory.mktemp("cache")))
    gateway = Gateway(registry, LocalPoolFactory())
    for v in ("1", "2"):
        registry.load("img", v)
    srv = serve_in_thread(gateway)
    yield srv
    asyncio.run_coroutine_threadsafe(gateway.close(), srv._loop).result()
    srv.stop()


def plan(server, version: str, **kw):
    # A device far slower than the cloud on a slow uplink: the frame is sent, in as few bytes as the budget allows.
    q = {"model": "img", "version": version, "edge": {"gflops": 1e-4}, "uplink": 1e5, "rtt": 5.0} | kw
    with SyncInferenceClient(server.address) as c:
        return c.plan(q).plan


def keys(answer) -> tuple[str, set[str]]:
    def key(d) -> str:
        return Encoding.from_dict(d["plan"]["encoding"] if "plan" in d else d["encoding"]).key

    return key(answer["plan"]), {key(e) for e in answer["frontier"]["entries"]}


def test_model_yaml_budget_applies_when_the_query_names_none(server):
    ans = plan(server, "1")
    assert ans["cut_id"] == L and ans["plan"]["agreement"] == 0.995
    key, front = keys(ans)
    assert key == "jpeg@90" and "jpeg@10" not in front  # 0.95 is below model.yaml's 0.99
    for e in ans["frontier"]["entries"]:
        assert e["plan"].get("agreement", 1.0) >= 0.99
    # Without a budget anywhere, no lossy codec is planned.
    assert keys(plan(server, "2"))[0] == "fp32"


def test_the_stricter_of_the_query_and_model_yaml_wins(server):
    assert keys(plan(server, "1", min_agreement=0.5))[0] == "jpeg@90"  # model.yaml's 0.99 still holds
    assert keys(plan(server, "2", min_agreement=0.5))[0] == "jpeg@10"  # the query's own budget, alone
    strict = plan(server, "1", min_agreement=0.999)
    key, front = keys(strict)
    assert key == "fp32" and not any("jpeg" in k for k in front)


def test_a_bad_min_agreement_in_the_query_is_refused_by_name(server):
    with SyncInferenceClient(server.address) as c:
        for bad in (1.5, "high", True):
            with pytest.raises(InvalidArgument) as e:
                c.plan({"model": "img", "version": "1", "edge": "rpi4", "uplink": 1e6, "min_agreement": bad})
            assert e.value.field == "min_agreement"
