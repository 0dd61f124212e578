"""`Plan` on the gateway over real gRPC on 127.0.0.1: the planner's plan and frontier
against the registry's cloud profile, cut ids the gateway then serves, and the errors."""

from __future__ import annotations

import asyncio
import json
import os

import grpc
import msgpack
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cluster.auth import Authorizer, TokenTable
from cluster.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    UnknownModelError,
    UnknownVersionError,
)
from cluster.gateway import Gateway, LocalPoolFactory
from cluster.protocol.client import InferenceClient, SyncInferenceClient, make_request
from cluster.registry import Registry
from cluster.server import serve_in_thread
from partitioner import Cut, boundary, build_graph
from planner import make_flops_profile
from tests.onnx_models import conv_bn_relu_chain

pytestmark = pytest.mark.grpc

TOKEN = "plan-token-5d6e7f8a9b0c1d2e"


def make_repo(root) -> str:
    """m@1 keeps device and cloud profiles; m@2 keeps none (no cloud profile to plan with)."""
    for v in ("1", "2"):
        d = os.path.join(root, "m", v)
        os.makedirs(os.path.join(d, "profiles"))
        path = os.path.join(d, "model.onnx")
        onnx.save(conv_bn_relu_chain(3, seed=int(v)), path)
        with open(os.path.join(d, "model.yaml"), "w") as fh:
            fh.write("frontier: {up_lo_bps: 100000, up_hi_bps: 1000000000, rtt_ms: 5}\n")
        if v == "1":
            g = build_graph(path)
            for name, gflops in (("device.json", 0.05), ("cloud.json", 50.0)):
                with open(os.path.join(d, "profiles", name), "w") as fh:
                    json.dump(make_flops_profile(g, device=name[:-5], gflops=gflops, fixed_ms=0.2).to_dict(), fh)
    return str(root)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = make_repo(tmp_path_factory.mktemp("repo"))
    registry = Registry(root, cache_dir=str(tmp_path_factory.mktemp("cache")))
    tokens = TokenTable.from_dicts([{"name": "cam", "token": TOKEN}])
    gateway = Gateway(registry, LocalPoolFactory(), authorizer=Authorizer(tokens))
    registry.load("m", "1")
    registry.load("m", "2")
    registry.set_default("m", "1")
    server = serve_in_thread(gateway)
    yield registry, gateway, server
    asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
    server.stop()


def query(**kw):
    q = {"model": "m", "version": "1", "edge": "rpi4", "uplink": 50e6, "rtt": 5.0}
    q.update(kw)
    return q


def head_outputs(registry, cut_id, x) -> dict[str, np.ndarray]:
    lv = registry.resolve("m", "1")
    head, _ = lv.files.splitter().split(lv.files.resolve_cut(cut_id))
    sess = ort.InferenceSession(head.model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))


def infer_with(client, registry, cut_id, x) -> np.ndarray:
    lv = registry.resolve("m", "1")
    graph = lv.files.splitter().graph
    cut = lv.files.resolve_cut(cut_id)
    sent = {"x": x} if not cut.device else head_outputs(registry, cut_id, x)
    resp = client.infer(make_request("m", "1", cut_id, {k: sent[k] for k in boundary(graph, cut)}))
    assert resp.served_by == "m@1"
    return resp.outputs["y"]


def test_plan_returns_the_planners_plan_and_frontier_and_its_cuts_are_served(stack):
    registry, _, server = stack
    lv = registry.resolve("m", "1")
    x = np.random.default_rng(3).standard_normal((1, 4, 5, 5)).astype(np.float32)
    want = ort.InferenceSession(lv.files.model_path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with SyncInferenceClient(server.address, token=TOKEN) as c:
        resp = c.plan(query(edge={"gflops": 1e-4}), request_id="p1")
        assert resp.request_id == "p1"
        ans = resp.plan
        assert (ans["model"], ans["version"], ans["cloud_profile"]) == ("m", "1", "profiles/cloud.json")
        plan = ans["plan"]
        assert plan["schema"] == "splitinfer.plan/1" and plan["cloud_device"] == "cloud"
        assert plan["edge_device"].startswith("roofline") and plan["link"]["up_bps"] == 50e6
        assert ans["cut_id"] == Cut(frozenset(plan["edge_layers"])).key
        # A 0.1 MFLOP/s device and a 50 GFLOP/s cloud on a fast link: offloading wins.
        assert ans["offload"] and plan["predicted"]["total_ms"] <= plan["baselines"]["edge_only"]["total_ms"]
        front = ans["frontier"]
        assert front["schema"] == "splitinfer.frontier/1" and front["entries"]
        assert front["link_range"]["up_lo_bps"] == 1e5 and front["link_range"]["up_hi_bps"] == 1e9
        cut_ids = {ans["cut_id"]} | {e["cut_id"] for e in front["entries"]}
        n_layers = len(lv.files.splitter().graph)
        for cut_id in sorted(cut_ids):
            if len(lv.files.resolve_cut(cut_id).device) == n_layers:
                continue  # edge-only: nothing to offload
            np.testing.assert_allclose(infer_with(c, registry, cut_id, x), want, rtol=1e-4, atol=1e-5)
        # A slow uplink moves work to the device (or keeps it there): never a bigger boundary.
        slow = c.plan(query(edge={"gflops": 1e-4}, uplink=1e5, frontier=False)).plan
        assert slow["frontier"] is None
        ref = c.plan(query(frontier=False)).plan  # a reference device by name
        assert ref["plan"]["edge_device"] == "rpi4"
        assert slow["plan"]["boundary_bytes"] <= plan["boundary_bytes"]


def test_plan_with_an_inline_profile_a_roofline_and_the_async_client(stack):
    registry, _, server = stack
    graph = registry.resolve("m", "1").files.splitter().graph
    inline = make_flops_profile(graph, device="my-board", gflops=0.5).to_dict()

    async def go():
        async with InferenceClient(server.address, token=TOKEN) as c:
            a = await c.plan(query(edge=inline, objective="energy", encoding="auto", frontier=False))
            b = await c.plan(query(edge={"gflops": 2.0}, objective="throughput", version="", device_id="d1"))
            return a.plan, b.plan

    a, b = asyncio.run(go())
    assert a["plan"]["edge_device"] == "my-board" and a["plan"]["objective"] == "energy"
    assert a["plan"]["encoding"]["precision"] in ("fp32", "fp16", "int8")
    # Routed version; the frontier covers latency and energy only.
    assert b["version"] == "1" and b["plan"]["objective"] == "throughput" and b["frontier"] is None


def test_plan_errors_name_what_is_wrong(stack):
    _, gateway, server = stack
    with SyncInferenceClient(server.address, token=TOKEN) as c:
        with pytest.raises(UnknownModelError, match="'nope'.*'m'"):
            c.plan(query(model="nope"))
        with pytest.raises(UnknownVersionError, match="'9'; known versions: .*'1'"):
            c.plan(query(version="9"))
        with pytest.raises(FailedPrecondition, match="m/2/profiles/cloud.json") as e:
            c.plan(query(version="2"))
        assert "splitinfer profile" in e.value.fix
        cases = [
            (query(uplink=-5), "uplink"),
            (query(uplink="fast"), "uplink"),
            (query(rtt=-1), "rtt"),
            (query(edge="toaster"), "edge"),
            (query(edge={"gflops": 0}), "edge.gflops"),
            (query(objective="speed"), "objective"),
            (query(slo=1e-6), "slo"),
            (query(cloud="t4"), "cloud"),
            (query(frontier="yes"), "frontier"),
            ({"edge": "rpi4", "uplink": 1e6}, "model"),
            (query(model=7), "model"),
        ]
        for q, field in cases:
            with pytest.raises(InvalidArgument) as e:
                c.plan(q)
            assert e.value.field == field, (q, e.value)
        with pytest.raises(InvalidArgument, match="rpi4"):
            c.plan(query(edge="toaster"))
        # A query that is not a map is a malformed message.
        raw = msgpack.packb({"v": [1, 0], "request_id": "r", "query": [1, 2]})
        with pytest.raises(grpc.RpcError) as rpc:
            c._plan(raw, timeout=10, metadata=c._metadata)
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with SyncInferenceClient(server.address, token="wrong-token-00000000") as c:
        for q in (query(), query(uplink=-5), {"nope": 1}):  # auth answers before the query is judged
            with pytest.raises(Unauthenticated):
                c.plan(q)


def test_plan_is_refused_for_a_model_the_token_does_not_allow(tmp_path):
    root = make_repo(tmp_path / "repo")
    registry = Registry(root)
    tokens = TokenTable.from_dicts([{"name": "cam", "token": TOKEN, "models": ["other"]}])
    gateway = Gateway(registry, LocalPoolFactory(), authorizer=Authorizer(tokens))
    registry.load("m", "1")
    server = serve_in_thread(gateway)
    try:
        with SyncInferenceClient(server.address, token=TOKEN) as c, pytest.raises(PermissionDenied):
            c.plan(query())
        assert gateway._planner is None  # refused before any planning
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()


def test_a_remembered_cut_resolves_by_its_id(stack):
    registry, _, _ = stack
    lv = registry.resolve("m", "1")
    cut = Cut(frozenset({0, 1}))
    lv.files.remember_cut(cut)
    assert os.path.exists(os.path.join(lv.files.path, "segments", cut.key, "cut.json"))
    assert lv.files.resolve_cut(cut.key) == cut
