"""Every feature model of "any model a user brings" through the whole workflow, as a user
types it: inspect, three random valid cuts split and verified, profile, plan, and one
request served through a real gateway on 127.0.0.1 (in-process pools), on the cloud-only
cut and on a split cut.

The models are the generated ones of the feature tests (symbolic H/W and sequence length,
a rank lost by ONNX inference, If with outer reads and weights in both branches, Loop,
Scan, int32/int64 inputs that feed Reshape, a recurrent state in and out, a Loop holding
an If). Each comes with sample inputs that take a real branch and give the integer shape
inputs valid values. One registry holds them all, and one gateway serves them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cluster.gateway import Gateway, LocalPoolFactory
from cluster.protocol.client import SyncInferenceClient, make_request
from cluster.registry import Registry
from partitioner import build_graph, down_closure
from splitinfer.partition_cmd import inspect_main, split_main
from splitinfer.plan_cmd import plan_main
from splitinfer.profile_cmd import profile_main
from splitinfer.registry_cmd import registry_main
from tests import control_flow_models as CF
from tests.integration._gateway_support import serving
from tests.unit import _shape_models as SM

pytestmark = pytest.mark.grpc

_FAST = ["--runs", "1", "--warmup", "0", "--segments", "0", "--no-progress", "--threads", "1"]
_TOL = 1e-4


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@dataclass(frozen=True)
class Case:
    name: str
    make_model: Callable[[], onnx.ModelProto]
    make_samples: Callable[[np.random.Generator], dict[str, np.ndarray]]


# Sample inputs: realistic values (sr = 16000 takes If's then-branch), integer shape inputs
# set to valid values; reshape_int64_batch2 gives two rows and a shape input that says so.
CASES = [
    Case("symbolic_hw", SM.conv_resize, lambda r: {"x": _f32(r, 1, 3, 8, 8)}),
    Case("sequence_length", SM.sequence, lambda r: {"ids": r.integers(0, 16, (1, 6)).astype(np.int64)}),
    Case("rank_lost", SM.reshape_by_input,
         lambda r: {"x": _f32(r, 1, 12), "shape": np.array([-1, 3, 4], np.int64)}),
    Case("if_outer_reads", CF.if_model, lambda r: {"x": _f32(r, 1, CF.D), "sr": np.array(16000, np.int64)}),
    Case("loop", CF.loop_model, lambda r: {"x": _f32(r, 1, CF.D)}),
    Case("scan", CF.scan_model, lambda r: {"x": _f32(r, 1, CF.T, CF.H), "s0": _f32(r, 1, CF.H)}),
    Case("reshape_int32", lambda: SM.reshape_by_input(onnx.TensorProto.INT32),
         lambda r: {"x": _f32(r, 1, 12), "shape": np.array([1, 3, 4], np.int32)}),
    Case("reshape_int64", lambda: SM.reshape_by_input(onnx.TensorProto.INT64),
         lambda r: {"x": _f32(r, 1, 12), "shape": np.array([1, 6, 2], np.int64)}),
    Case("reshape_int64_batch2", lambda: SM.reshape_by_input(onnx.TensorProto.INT64),
         lambda r: {"x": _f32(r, 2, 12), "shape": np.array([2, 6, 2], np.int64)}),
    Case("state", lambda: CF.state_model(with_if=False),
         lambda r: {"x": _f32(r, 1, CF.D), "state": _f32(r, 1, CF.D)}),
    Case("recurrent_state", SM.recurrent_state, lambda r: {"x": _f32(r, 1, 4), "h": _f32(r, 2, 1, 4)}),
    Case("nested", CF.nested_model, lambda r: {"x": _f32(r, 1, CF.D)}),
]
_XFAIL: dict[str, str] = {}
"""Case name -> the cause of a step that fails for it (strict xfail: the case fails the
suite the day it passes)."""


def _params():
    return [pytest.param(c, id=c.name, marks=[pytest.mark.xfail(strict=True, reason=_XFAIL[c.name])]
                         if c.name in _XFAIL else []) for c in CASES]


def _run(model: onnx.ModelProto | str, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {k: feed[k] for k in names})))


def _head_then_tail(head: onnx.ModelProto | str, tail: onnx.ModelProto | str,
                    feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs of head then tail: the tail reads what the head made and the model inputs it needs."""
    known = {**feed, **_run(head, feed)}
    return {**known, **_run(tail, known)}


def _assert_equal_to_whole(got: dict[str, np.ndarray], whole: dict[str, np.ndarray], what: str) -> None:
    for name, want in whole.items():
        assert name in got, f"{what}: output {name!r} missing (got {sorted(got)})"
        np.testing.assert_allclose(got[name], want, rtol=_TOL, atol=_TOL, err_msg=f"{what}: output {name!r}")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[str, str, dict[str, np.ndarray]]]:
    """Case name -> (model path, sample .npz path, samples)."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for i, case in enumerate(CASES):
        path, npz = root / f"{case.name}.onnx", root / f"{case.name}.npz"
        onnx.save(case.make_model(), str(path))
        samples = case.make_samples(np.random.default_rng(i))
        np.savez(npz, **samples)
        out[case.name] = (str(path), str(npz), samples)
    return out


@pytest.fixture(scope="module")
def stack(files, tmp_path_factory):
    """One registry with every model (``registry add MODEL REGISTRY --inputs S.npz``), one gateway."""
    reg = tmp_path_factory.mktemp("registry") / "repo"
    added = {}
    for case in CASES:
        path, npz, _ = files[case.name]
        try:
            added[case.name] = registry_main(["add", path, str(reg), "--inputs", npz])
        except Exception as e:  # noqa: BLE001 - a refused add is that case's finding, asserted in its test
            added[case.name] = f"{type(e).__name__}: {e}"
    registry = Registry(str(reg), cache_dir=str(tmp_path_factory.mktemp("cache")))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path_factory.mktemp("ort"))))
    with serving(gateway, start_timeout_s=300) as server:
        yield gateway, server, added


def _random_cuts(path: str, samples: dict[str, np.ndarray], n: int, seed: int) -> list[list[int]]:
    """Up to ``n`` distinct valid cuts that leave layers on both sides: the down-closure of
    a random layer (a seeded rng), as `split --edge-layers` takes them."""
    graph = build_graph(onnx.load(path), inputs=samples)
    rng = random.Random(seed)
    cuts: list[list[int]] = []
    for _ in range(50):
        device = sorted(down_closure(graph, [rng.randrange(len(graph))]))
        if 0 < len(device) < len(graph) and device not in cuts:
            cuts.append(device)
        if len(cuts) == n:
            break
    assert cuts, f"{path}: {len(graph)} layers leave no cut with layers on both sides"
    return cuts


@pytest.mark.parametrize("case", _params())
def test_the_whole_workflow(case: Case, files, stack, tmp_path, capsys):
    path, npz, samples = files[case.name]
    whole = _run(path, samples)

    # 1. inspect: every boundary tensor of the chain cuts has a known size
    assert inspect_main([path, "--inputs", npz, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    tensors = {t["name"]: t for t in info["tensors"]}
    for point in info["chain_points"]:
        crossing = [t for t in tensors.values()
                    if (t["producer"] is None or t["producer"] <= point) and any(c > point for c in t["consumers"])]
        unknown = [t["name"] for t in crossing if t["bytes_per_sample"] is None]
        assert not unknown, f"cut after layer {point}: unknown size of {unknown}"

    # 2. three random valid cuts, each split and verified by the command and here
    splits = []
    for i, device in enumerate(_random_cuts(path, samples, 3, seed=len(case.name))):
        out = tmp_path / f"split{i}"
        layers = ",".join(map(str, device))
        assert split_main([path, "--edge-layers", layers, "-o", str(out), "--verify", "--inputs", npz]) == 0
        split_info = json.loads((out / "split.json").read_text())
        assert split_info["edge_layers"] == device
        assert split_info["boundary_bytes_per_sample"] is not None, split_info["boundary"]
        assert max(split_info["verify_max_abs_diff"].values(), default=0.0) <= _TOL
        got = _head_then_tail(str(out / "head.onnx"), str(out / "tail.onnx"), samples)
        _assert_equal_to_whole(got, whole, f"--edge-layers {layers}")
        splits.append((split_info, out))
    capsys.readouterr()

    # 3. profile: a time for every layer
    prof = tmp_path / "device.json"
    assert profile_main([path, "-o", str(prof), "--inputs", npz, *_FAST]) == 0
    layers_ms = json.loads(prof.read_text())["layers"]
    assert set(layers_ms) == {str(i) for i in range(len(info["layers"]))}
    capsys.readouterr()

    # 4. plan with that profile as the device and a reference cloud
    assert plan_main([path, "--edge", str(prof), "--cloud", "t4", "--uplink", "10mbit", "--rtt", "20ms",
                      "--inputs", npz, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["predicted"]["total_ms"] > 0 and plan["boundary_bytes"] is not None, plan

    # 5. one request through the gateway: cloud-only, on a split cut of the frontier where it
    # has one, and on a random cut of step 2
    gateway, server, added = stack
    assert added[case.name] == 0, added[case.name]
    _, detail = gateway.readiness()
    failed = {k: why for k, why in detail["failed"].items() if k == case.name or k.startswith(f"{case.name}@")}
    assert not failed, failed
    lv = gateway.registry.resolve(case.name, "1")
    cuts = {c.cut_id: c for c in lv.frontier.cuts}
    split_cuts = [c for c in lv.frontier.cuts if c.edge_layers]
    assert "L" in cuts, sorted(cuts)
    with SyncInferenceClient(server.address) as client:
        resp = client.infer(make_request(case.name, "1", "L", samples))
        _assert_equal_to_whole(resp.outputs, whole, "cloud-only cut L")
        for cut in split_cuts[:1]:
            head, _ = lv.files.splitter().split(lv.files.resolve_cut(cut.cut_id))
            known = {**samples, **_run(head.model, samples)}
            resp = client.infer(make_request(case.name, "1", cut.cut_id, {k: known[k] for k in cut.boundary}))
            _assert_equal_to_whole({**known, **resp.outputs}, whole, f"frontier cut {cut.cut_id}")
        # the first random cut of step 2, served on demand: its head is the one `split` wrote
        split_info, out = splits[0]
        known = {**samples, **_run(str(out / "head.onnx"), samples)}
        resp = client.infer(make_request(case.name, "1", split_info["cut_id"],
                                         {k: known[k] for k in split_info["boundary"]}))
        _assert_equal_to_whole({**known, **resp.outputs}, whole, f"random cut {split_info['cut_id']}")
