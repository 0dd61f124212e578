"""The KServe Python client's side of tests/integration/test_oip_kserve.py, in a process of its own.

kserve and tritonclient.grpc both register the OIP messages (`inference.ServerLiveRequest`, ...)
in protobuf's default descriptor pool from different .proto files, so the second one imported
into a process fails ("duplicate symbol"); the test suite imports tritonclient.grpc. Run as
`python -m tests.integration._kserve_client`: a JSON job on stdin, a JSON report on stdout.

Job: {"door": "rest" | "grpc", "target": URL or host:port, "auth": {header: value},
      "binary": bool, "cases": [{"name", "inputs": {name: tensor}}], "errors": [same]}
Report: {"live", "ready", "model_ready": {name: bool}, "outputs": {name: tensor},
         "errors": [[status, message]]}; a tensor is {"shape", "b64"} of float32 bytes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from typing import Any

import numpy as np


def to_array(t: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(t["b64"]), np.float32).reshape(t["shape"])


def to_tensor(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a, np.float32)
    return {"shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def request(kserve: Any, name: str, inputs: dict[str, Any], binary: bool) -> Any:
    out = []
    for input_name, t in inputs.items():
        a = to_array(t)
        i = kserve.InferInput(input_name, list(a.shape), "FP32")
        i.set_data_from_numpy(a, binary_data=binary)
        out.append(i)
    return kserve.InferRequest(model_name=name, infer_inputs=out)


async def run_rest(kserve: Any, job: dict[str, Any]) -> dict[str, Any]:
    import httpx

    url, auth = job["target"], job["auth"]
    client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", retries=0))
    report: dict[str, Any] = {"model_ready": {}, "outputs": {}, "errors": []}
    try:
        report["live"] = await client.is_server_live(url)
        report["ready"] = await client.is_server_ready(url)
        for case in job["cases"]:
            name = case["name"]
            report["model_ready"][name] = await client.is_model_ready(url, name, headers=auth)
            r = await client.infer(url, request(kserve, name, case["inputs"], job["binary"]), model_name=name,
                                   headers=dict(auth))
            report["outputs"][name] = to_tensor(r.get_output_by_name("y").as_numpy())
        for case in job["errors"]:
            try:
                await client.infer(url, request(kserve, case["name"], case["inputs"], job["binary"]),
                                   model_name=case["name"], headers=dict(auth))
                report["errors"].append([200, ""])
            except httpx.HTTPStatusError as e:
                report["errors"].append([e.response.status_code, e.response.json()["error"]])
    finally:
        await client.close()
    return report


async def run_grpc(kserve: Any, job: dict[str, Any]) -> dict[str, Any]:
    import grpc

    auth = tuple(job["auth"].items())
    client = kserve.InferenceGRPCClient(job["target"], retries=0)
    report: dict[str, Any] = {"model_ready": {}, "outputs": {}, "errors": []}
    try:
        report["live"] = await client.is_server_live(headers=auth)
        report["ready"] = await client.is_server_ready(headers=auth)
        for case in job["cases"]:
            name = case["name"]
            report["model_ready"][name] = await client.is_model_ready(name, headers=auth)
            r = await client.infer(request(kserve, name, case["inputs"], True), headers=auth)
            report["outputs"][name] = to_tensor(r.get_output_by_name("y").as_numpy())
        for case in job["errors"]:
            try:
                await client.infer(request(kserve, case["name"], case["inputs"], True), headers=auth)
                report["errors"].append(["OK", ""])
            except grpc.aio.AioRpcError as e:
                report["errors"].append([e.code().name, e.details()])
    finally:
        await client.close()
    return report


def main() -> None:
    import kserve

    job = json.load(sys.stdin)
    run = run_rest if job["door"] == "rest" else run_grpc
    json.dump(asyncio.run(run(kserve, job)), sys.stdout)


if __name__ == "__main__":
    main()
