"""The e2e benchmark's edge device: a child process that runs heads and calls the gateway.

Run as ``python -m bench._e2e_edge ADDRESS MODEL VERSION``. It reads one JSON line, the
set-up (the full model's path and, per candidate, the head segment's path, the boundary
names, the wire cut id and the device's ``slowdown``), loads every ONNX Runtime session
with one thread, prints ``ready`` and waits for ``go``. Its heads and encodes take the
slowdown times their CPU time (edge_agent.device, [Note: time-scaled device]). Each later line
is a job ``{"id", "precision", "reps", "check"}`` (``precision``: an encoding key, ``int8+pc``
or ``jpeg@90`` too; with ``check`` the first answer's agreement with the whole model is
returned as ``check_agreement``) or ``{"op": "add", "candidate"}`` (one more head) or
``{"op": "load", "id", "precision", "rate_hz", "n"}`` (Poisson arrivals, see `_load`): the child runs the candidate `reps` times end
to end (head, encode, gRPC call through the link emulator, answer) and prints one JSON
line with every request's stage times. ``{"op": "quit"}`` ends it.

The stages are timed here, on the device, as a client sees them: `edge_ms` (the head),
`encode_ms` (casting the boundary to fp16/int8 or through a lossy codec, and building the request) and
`remote_ms` (the call: uplink, the cloud's decode, queue and tail, downlink). The
gateway's own timings come back in each response and are kept as `server`.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

__all__: list[str] = []


def _session(path: str) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


def _wire_tensor(arr: Any, key: str) -> Any:
    """The boundary tensor `arr` as the encoding key ``fp32``, ``fp16``, ``int8``, ``int8+pc`` or
    ``CODEC@LEVEL`` (a lossy codec: ``jpeg@90``) sends it ([Note: encoding keys] in planner.accuracy)."""
    import numpy as np

    from cluster.protocol.encoding import encode

    if arr.dtype != np.float32 or key == "fp32":
        return np.ascontiguousarray(arr)
    if key == "int8+pc":
        return encode(arr, precision="int8", per_channel=True)
    codec, _, level = key.partition("@")
    return encode(arr, precision=codec, level=int(level)) if level else encode(arr, precision=codec)


def _request(c: dict[str, Any], precision: str, sessions: dict[str, Any], feed: dict[str, Any], model: str,
             version: str, device: Any) -> tuple[Any, float, float, int]:
    """Runs the head and builds the request on `device` (an edge_agent.device.SlowDevice):
    (request or None for edge-only, edge_ms, encode_ms, wire bytes). `precision` is the
    encoding's key (`_wire_tensor`)."""
    import numpy as np

    from cluster.protocol.client import make_request

    if c["local"]:
        _, edge_ms = device.run(lambda: sessions["__full__"].run(None, feed))
        return None, edge_ms, 0.0, 0
    values = dict(feed)
    sess = sessions.get(c["id"])
    edge_ms = 0.0
    if sess is not None:
        names = [o.name for o in sess.get_outputs()]
        ins = {i.name for i in sess.get_inputs()}
        outs, edge_ms = device.run(lambda: sess.run(names, {k: v for k, v in feed.items() if k in ins}))
        values.update(zip(names, outs))

    def encoded() -> tuple[Any, int]:
        tensors = {name: _wire_tensor(values[name], precision) for name in c["boundary"]}
        wire = sum(t.nbytes if isinstance(t, np.ndarray) else len(t.payload) for t in tensors.values())
        return make_request(model, version, c["cut_key"], tensors, timeout_s=120.0), wire

    (req, wire), encode_ms = device.run(encoded)
    return req, edge_ms, encode_ms, wire


def _check(outputs: Any, reference: dict[str, Any]) -> float | None:
    """The answer's agreement with the whole fp32 model on the same input (`workers.agreement`),
    over the outputs the cloud sent (a head may compute others on the device)."""
    import numpy as np

    from cluster.protocol.encoding import decode
    from workers.agreement import compare_runs

    got = {k: v if isinstance(v, np.ndarray) else decode(v) for k, v in outputs.items()}
    common = sorted(set(got) & set(reference))
    if not common:
        return None
    return compare_runs([{k: reference[k] for k in common}], [{k: got[k] for k in common}]).agreement


def _job(c: dict[str, Any], job: dict[str, Any], sessions: dict[str, Any], feed: dict[str, Any],
         client: Any, model: str, version: str, reference: dict[str, Any], device: Any) -> dict[str, Any]:
    precision = job.get("precision", "fp32")
    rows = []
    check = 1.0 if c["local"] else None
    for i in range(int(job["reps"])):
        t0 = time.perf_counter()
        req, edge_ms, encode_ms, wire = _request(c, precision, sessions, feed, model, version, device)
        t2 = time.perf_counter()
        server: dict[str, float] = {}
        answer = None
        if req is not None:
            answer = client.infer(req)
            server = dict(answer.timings_ms)
        t3 = time.perf_counter()
        rows.append({"edge_ms": edge_ms, "encode_ms": encode_ms, "remote_ms": (t3 - t2) * 1e3 if req else 0.0,
                     "total_ms": (t3 - t0) * 1e3, "wire_bytes": wire, "server": server})
        if i == 0 and answer is not None and job.get("check"):
            check = _check(answer.outputs, reference)
    return {"id": c["id"], "precision": precision, "rows": rows, "check_agreement": check}


def _load(c: dict[str, Any], job: dict[str, Any], sessions: dict[str, Any], feed: dict[str, Any],
          client: Any, model: str, version: str, reference: dict[str, Any], device: Any) -> dict[str, Any]:
    """Poisson arrivals at `rate_hz`: heads run in arrival order on the one edge thread (a
    request waits while the device is busy), calls overlap in flight."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    n, rate = int(job["n"]), float(job["rate_hz"])
    max_s = float(job.get("max_s") or "inf")
    gaps = np.random.default_rng(int(job.get("seed", 0))).exponential(1.0 / rate, n)
    start = time.perf_counter() + 0.05
    arrivals = start + np.cumsum(gaps)
    offered = 0
    finished: list[tuple[float, float]] = []
    lock = threading.Lock()
    errors: list[str] = []

    def call(req: Any, arrival: float) -> None:
        try:
            client.infer(req)
        except Exception as e:  # noqa: BLE001 - counted, reported to the parent
            errors.append(f"{type(e).__name__}: {str(e)[:120]}")
            return
        with lock:
            finished.append((arrival, time.perf_counter()))

    with ThreadPoolExecutor(max_workers=16) as pool:
        for a in arrivals:
            if time.perf_counter() - start > max_s:
                break  # a slow pick has answered enough to show its rate; the rest are not sent
            offered += 1
            delay = a - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            req, *_ = _request(c, job.get("precision", "fp32"), sessions, feed, model, version, device)
            if req is None:
                finished.append((a, time.perf_counter()))
            else:
                pool.submit(call, req, float(a))
    lat = sorted((f - a) * 1e3 for a, f in finished)
    span_s = max(f for _, f in finished) - float(arrivals[0]) if finished else float("nan")
    return {"id": c["id"], "n": n, "sent": offered, "answered": len(finished), "errors": errors[:3], "offered_hz": rate,
            "span_s": span_s, "latency_ms": lat}


def _warm_codecs() -> None:
    """Every encoding once on a small image, outside the device's time: the first lossy encode
    imports Pillow and zstandard, which no request should pay for."""
    import numpy as np

    x = np.random.default_rng(0).random((1, 3, 16, 16), dtype=np.float32)
    for key in ("fp16", "int8", "int8+pc", "jpeg@90", "webp@90", "tiled-jpeg@90", "tiled-webp@90", "bits@4"):
        try:
            _wire_tensor(x, key)
        except Exception:  # noqa: BLE001 - a codec that cannot run here fails in its own job, with its reason
            pass


def main(argv: list[str]) -> int:
    import numpy as np

    from cluster.protocol.client import SyncInferenceClient
    from edge_agent.device import SlowDevice

    address, model, version = argv[0], argv[1], argv[2]
    setup = json.loads(sys.stdin.readline())
    device = SlowDevice(float(setup.get("slowdown", 1.0)))
    cands = {c["id"]: c for c in setup["candidates"]}
    sessions = {"__full__": _session(setup["model_path"])}
    for c in cands.values():
        if c.get("head_path"):
            sessions[c["id"]] = _session(c["head_path"])
    rng = np.random.default_rng(int(setup.get("seed", 0)))
    feed = {i.name: rng.standard_normal([d if isinstance(d, int) and d > 0 else 1 for d in i.shape]).astype(np.float32)
            for i in sessions["__full__"].get_inputs()}
    if setup.get("inputs_path"):  # the first of the accuracy table's samples: what the codecs were measured on
        with np.load(setup["inputs_path"]) as z:
            feed = {k: np.ascontiguousarray(z[k][:1]) if z[k].ndim else z[k] for k in z.files}
    full = sessions["__full__"]
    reference = dict(zip([o.name for o in full.get_outputs()], full.run(None, feed)))
    for s in sessions.values():  # first runs allocate; keep that out of the measured ones
        s.run(None, {k: v for k, v in feed.items() if k in {i.name for i in s.get_inputs()}})
    _warm_codecs()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    with SyncInferenceClient(address) as client:
        for line in sys.stdin:
            job = json.loads(line)
            if job.get("op") == "quit":
                break
            if job.get("op") == "add":
                c = job["candidate"]
                try:
                    cands[c["id"]] = c
                    if c.get("head_path"):
                        sessions[c["id"]] = _session(c["head_path"])
                    print(json.dumps({"added": c["id"]}), flush=True)
                except Exception as e:  # noqa: BLE001 - the parent reports it
                    print(json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
                continue
            try:
                run = _load if job.get("op") == "load" else _job
                out = run(cands[job["id"]], job, sessions, feed, client, model, version, reference, device)
            except Exception as e:  # noqa: BLE001 - the parent records the failure with its reason
                out = {"id": job.get("id"), "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
