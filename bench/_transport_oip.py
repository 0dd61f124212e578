"""The Open Inference Protocol doors against the native Infer, through one deployed gateway.

`splitinfer gateway` runs in its own process (in-process pools, as `--ray-address
local-noray` deploys it) over a registry of two one-node models (Relu over an fp32
[1, K] tensor: 4 KiB and 1 MiB), and this process calls the same whole model (`NAME`,
the empty cut 'L') through each door:

    native           our Infer (cluster.protocol.client.SyncInferenceClient)
    oip_grpc         ModelInfer with raw_input_contents, the spec's messages over a plain
                     grpc channel (cluster._oip_pb): the door's cost, with as little client
                     work as our own client does (one encode, one decode per call)
    oip_grpc_triton  ModelInfer through tritonclient.grpc, as a Triton user calls it
    rest_binary      POST /v2/models/NAME/infer with Triton's binary-data extension
                     (tritonclient.http, binary input and output)
    rest_json        the same with JSON tensors (tritonclient.http, binary_data=False)

Every answer is checked against max(x, 0) before timing. The gRPC doors and REST binary
are interleaved call by call with the native Infer in rounds (bench.transport's
`_interleaved`), and each ratio is taken within a round; REST JSON, 100x slower at
1 MiB, runs in rounds of its own, again interleaved with the native Infer.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from cluster.protocol.client import SyncInferenceClient, make_request

__all__ = ["OIP_SIZES", "bench_oip"]

OIP_SIZES = {"oip4k": 4 << 10, "oip1m": 1 << 20}
"""Registry model -> bytes of its one fp32 input (and of its output)."""
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OPTS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def _write_registry(root: str) -> str:
    import onnx
    from onnx import TensorProto, helper

    for name, size in OIP_SIZES.items():
        d = os.path.join(root, "repo", name, "1")
        os.makedirs(d)
        shape = [1, size // 4]
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], name,
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), os.path.join(d, "model.onnx"))
    return os.path.join(root, "repo")


class _Gateway:
    """`splitinfer gateway` in its own process: its gRPC address and its HTTP host:port."""

    def __init__(self, root: str) -> None:
        cmd = [sys.executable, "-m", "splitinfer", "gateway", "--registry", _write_registry(root), "--port", "0",
               "--metrics-port", "0", "--log-level", "WARNING", "--cache-dir", os.path.join(root, "cache")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=_ROOT)
        line = self.proc.stdout.readline()
        m = re.search(r"serving on (\S+), metrics on http://(\S+)", line)
        if m is None:
            self.close()
            raise RuntimeError(f"splitinfer gateway did not start: {line!r}")
        self.address, self.http = m.group(1), m.group(2).rstrip("/")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _triton(gw: _Gateway) -> tuple[Any, Any, Any, Any] | None:
    """(tritonclient.grpc, .http, a gRPC client, an HTTP client) of the gateway, or None without tritonclient."""
    try:
        import tritonclient.grpc as tg
        import tritonclient.http as th
    except (ImportError, RuntimeError):  # tritonclient[grpc] on a grpcio older than 1.81.1 raises RuntimeError
        return None
    return tg, th, tg.InferenceServerClient(gw.address), th.InferenceServerClient(gw.http)


def _clients(native: SyncInferenceClient, channel: grpc.Channel, triton: tuple[Any, Any, Any, Any] | None,
             name: str, x: np.ndarray) -> dict[str, Callable[[], np.ndarray]]:
    from cluster._oip_pb import oip_pb2 as pb

    model_infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    shape = list(x.shape)

    def native_infer() -> np.ndarray:
        return native.infer(make_request(name, "1", "L", {"x": x}, timeout_s=30)).outputs["y"]

    def oip_grpc() -> np.ndarray:
        req = pb.ModelInferRequest(model_name=name, inputs=[pb.ModelInferRequest.InferInputTensor(
            name="x", datatype="FP32", shape=shape)], raw_input_contents=[x.tobytes()])
        resp = pb.ModelInferResponse.FromString(model_infer(req.SerializeToString(), timeout=30))
        return np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(resp.outputs[0].shape)

    fns: dict[str, Callable[[], np.ndarray]] = {"native": native_infer, "oip_grpc": oip_grpc}
    if triton is None:
        return fns
    tg, th, triton_grpc, triton_http = triton

    def oip_grpc_triton() -> np.ndarray:
        i = tg.InferInput("x", shape, "FP32")
        i.set_data_from_numpy(x)
        return triton_grpc.infer(name, [i], client_timeout=30).as_numpy("y")

    def rest(binary: bool) -> Callable[[], np.ndarray]:
        def call() -> np.ndarray:
            i = th.InferInput("x", shape, "FP32")
            i.set_data_from_numpy(x, binary_data=binary)
            out = th.InferRequestedOutput("y", binary_data=binary)
            return triton_http.infer(name, [i], outputs=[out], timeout=30_000_000).as_numpy("y")

        return call

    fns.update(oip_grpc_triton=oip_grpc_triton, rest_binary=rest(True), rest_json=rest(False))
    return fns


def _per_round(rounds: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] / r["native"] for r in rounds]


def bench_oip(quick: bool, interleaved: Callable[..., dict[str, float]]) -> list[dict[str, Any]]:
    """One row per size: median ms of each door and each door / native (median of per-round ratios)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gw = _Gateway(tmp)
        native = SyncInferenceClient(gw.address)
        channel = grpc.insecure_channel(gw.address, options=_OPTS)
        triton = _triton(gw)
        try:
            t0 = time.monotonic()
            while native.health() != "SERVING":
                if time.monotonic() - t0 > 120:
                    raise RuntimeError("the gateway was not SERVING within 120 s")
                time.sleep(0.1)
            for name, size in OIP_SIZES.items():
                x = np.random.default_rng(4).standard_normal((1, size // 4)).astype(np.float32)
                fns = _clients(native, channel, triton, name, x)
                want = np.maximum(x, 0)
                for door, fn in fns.items():
                    if not np.array_equal(fn(), want):
                        raise AssertionError(f"{door} answered {name} wrongly")
                json_fn = fns.pop("rest_json", None)
                small = size <= 64 << 10
                n = (400 if small else 60) // (4 if quick else 1)
                rounds = [interleaved(fns, n) for _ in range(1 if quick else 5)]
                med = {k: statistics.median(r[k] for r in rounds) for k in fns}
                row: dict[str, Any] = {"size_bytes": size, "rounds": len(rounds), "median_ms": med}
                for door in fns:
                    if door != "native":
                        per = _per_round(rounds, door)
                        row[f"{door}_vs_native"] = statistics.median(per)
                        row[f"{door}_vs_native_per_round"] = per
                if json_fn is not None:
                    jn = 40 if small else 4
                    json_rounds = [interleaved({"native": fns["native"], "rest_json": json_fn}, jn, warmup=2)
                                   for _ in range(1 if quick else 3)]
                    med["rest_json"] = statistics.median(r["rest_json"] for r in json_rounds)
                    row["rest_json_vs_native"] = statistics.median(_per_round(json_rounds, "rest_json"))
                    row["rest_json_vs_native_per_round"] = _per_round(json_rounds, "rest_json")
                row["loadavg_1min"] = os.getloadavg()[0]
                rows.append(row)
        finally:
            if triton is not None:
                triton[2].close()
                triton[3].close()
            channel.close()
            native.close()
            gw.close()
    return rows
