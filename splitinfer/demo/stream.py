"""The demo's live phase: requests through the edge agent's local API while the link
replays the trace, a one-line-per-second table, and the check of every answer against
the whole model run locally.

The sender is an app like any other: it calls the agent's local API with `EdgeClient`
at a fixed frame rate, with at most `window` requests in flight (a camera drops a frame
rather than queue without bound, so a skipped tick is counted, not sent). A frame is
skipped exactly when its tick finds `window` requests unanswered; each skip keeps the ids
that filled the window, so the report can say what held them (`skip_reasons`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from splitinfer.netem import TraceStep, load_trace, shipped_trace_path

__all__ = ["REL_TOL", "SERVED_AS", "make_tolerances", "measure_encoding_errors", "Record", "StreamResult", "make_trace", "reference_outputs", "served_as",
           "skip_reasons", "stream"]

# The tolerance an fp32 boundary must meet: the same arithmetic split in two sessions,
# relative to the output's scale (random weights make absolute scales arbitrary).
FP32_REL_TOL = 1e-3
# An fp16 boundary rounds every value to 11 significant bits (relative 4.9e-4) before the
# tail; ten times the fp32 tolerance leaves room for the tail to amplify that. The demo
# replaces it with the error measured before the stream (`measure_encoding_errors`).
REL_TOL = {"fp32": FP32_REL_TOL, "fp16": 1e-2}


SERVED_AS = ("split", "remote", "local", "local_tail")
"""How an answer was served: head here and tail in the cloud (`split`), the whole model in
the cloud (`remote`), the whole model here (`local`), or the cloud failed or was late and
the device finished it (`local_tail`)."""


def served_as(served_by: str, cut_id: str, n_layers: int) -> str:
    """`split` for a remote answer whose cut keeps some, not all, layers on the device;
    otherwise the agent's `served_by` ('remote', 'local', 'local_tail', 'error')."""
    from partitioner import Cut

    if served_by != "remote":
        return served_by
    cut = Cut.from_key(cut_id) if cut_id else None
    return "split" if cut is not None and 0 < len(cut.device) < n_layers else "remote"


def make_trace(scale: float) -> list[TraceStep]:
    """The shipped demo trace (fast, step down, outage, recovery) with its times scaled."""
    steps = load_trace(shipped_trace_path("demo"))
    return [TraceStep(s.t_s * scale, s.setting) for s in steps]


@dataclasses.dataclass(frozen=True)
class Record:
    """One request as the app saw it."""

    request_id: str
    input_index: int
    sent_s: float
    """Seconds since the stream started."""
    done_s: float
    served_by: str
    """remote, local, local_tail; 'error' when the agent answered with an error."""
    cut_id: str
    latency_ms: float
    """As the app measured it (HTTP included)."""
    agent_latency_ms: float
    link_up_bps: float
    """The emulated uplink when the request was sent (0 in an outage)."""
    fallback_reason: str
    rel_err: float
    """max |answer - reference| / max |reference|; NaN for errors."""
    encoding: str = "fp32"
    """How the boundary crossed the link (the agent's answer says); fp32 for local answers."""
    served: str = ""
    """`served_as`: split, remote, local, local_tail or error."""



@dataclasses.dataclass
class StreamResult:
    records: list[Record]
    timeline: list[dict[str, Any]]
    sent: int
    skipped_ticks: int
    answers_per_id: dict[str, int]
    duration_s: float
    skips: list[tuple[float, list[str]]] = dataclasses.field(default_factory=list)
    """(seconds since the start, ids in flight) of each skipped frame."""


def skip_reasons(res: StreamResult) -> dict[str, int]:
    """Skipped frames by what held the window: `device busy` when a request in it was being
    answered on the device (local or local_tail), else `waiting on the cloud`."""
    served = {r.request_id: r.served for r in res.records}
    out = {"device busy (local run in the window)": 0, "waiting on the cloud (remote or split in the window)": 0}
    for _, ids in res.skips:
        local = any(served.get(i) in ("local", "local_tail", "error") for i in ids)
        out["device busy (local run in the window)" if local else "waiting on the cloud (remote or split in the window)"] += 1
    return out


def reference_outputs(model_path: str, inputs: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The whole model on this host (ONNX Runtime, every core): what every answer must equal."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # the zoo models carry unused initializers ORT warns about
    sess = ort.InferenceSession(model_path, sess_options=opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return [dict(zip(names, sess.run(None, dict(x)))) for x in inputs]


def measure_encoding_errors(model: Any, graph: Any, cuts: Sequence[Any], encodings: Sequence[str],
                            inputs: Sequence[Mapping[str, np.ndarray]],
                            refs: Sequence[Mapping[str, np.ndarray]]) -> dict[str, float]:
    """The largest relative error (as `_rel_err`) of each encoding other than fp32 over
    `cuts` and `inputs`: the head runs, its float32 boundary tensors are cast to the
    encoding and back, as the agent sends them, and the tail runs."""
    from partitioner import Splitter, run_segments

    casts = {"fp16": np.float16}
    splitter = Splitter(model, graph)
    worst: dict[str, float] = {}
    for cut in cuts:
        head, tail = splitter.split(cut, check=False)
        for enc in encodings:
            if enc not in casts:
                continue
            for x, ref in zip(inputs, refs):
                env = run_segments([head], x) if head.layers else dict(x)
                sent = {k: (env[k].astype(casts[enc]).astype(np.float32) if env[k].dtype == np.float32 else env[k])
                        for k in tail.inputs}
                out = {**env, **run_segments([tail], sent)}
                worst[enc] = max(worst.get(enc, 0.0), _rel_err({k: out[k] for k in ref}, ref))
    return worst


def make_tolerances(measured: Mapping[str, float]) -> dict[str, float]:
    """Per encoding: fp32's tolerance, and for each measured encoding its measured error plus
    fp32's (the same arithmetic in other sessions); `REL_TOL`'s for the rest."""
    return {**REL_TOL, **{e: float(m) + FP32_REL_TOL for e, m in measured.items()}}


def _rel_err(outputs: Mapping[str, Any], ref: Mapping[str, np.ndarray]) -> float:
    worst = 0.0
    for k, r in ref.items():
        a = np.asarray(outputs[k], dtype=np.float64)
        scale = max(float(np.max(np.abs(r))), 1e-12)
        worst = max(worst, float(np.max(np.abs(a - r))) / scale)
    return worst


class _Sender:
    """Blocking sends from a small thread pool, one EdgeClient per thread."""

    def __init__(self, socket_path: str, window: int) -> None:
        self.socket_path = socket_path
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=window, thread_name_prefix="demo-app")
        self.local = threading.local()
        self.clients: list[Any] = []
        self.lock = threading.Lock()

    def send(self, inputs: Mapping[str, np.ndarray], request_id: str) -> tuple[dict[str, Any] | None, str]:
        from edge_agent.client import EdgeClient

        c = getattr(self.local, "client", None)
        if c is None:
            c = self.local.client = EdgeClient(unix_socket=self.socket_path, timeout_s=120.0)
            with self.lock:
                self.clients.append(c)
        try:
            return c.infer_full(dict(inputs), request_id=request_id), ""
        except Exception as e:  # noqa: BLE001 - an error answer is recorded, and counts as answered-with-error
            return None, f"{type(e).__name__}: {e}"

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for c in self.clients:
            c.close()


async def stream(*, socket_path: str, inputs: Sequence[Mapping[str, np.ndarray]],
                 refs: Sequence[Mapping[str, np.ndarray]],
                 duration_s: float, fps: float, window: int, start_trace: Callable[[], None],
                 link_now: Callable[[], dict[str, Any]], status: Callable[[], Awaitable[dict[str, Any]]],
                 label_cut: Callable[[str], str], n_layers: int, say: Callable[[str], None] = print,
                 stop: Callable[[], bool] = lambda: False) -> StreamResult:
    """Sends frames for `duration_s` and prints one line per second; returns what happened.
    `stop()` true ends it early by cancellation (the demo's Ctrl-C)."""
    loop = asyncio.get_running_loop()
    sender = _Sender(socket_path, window)
    records: list[Record] = []
    timeline: list[dict[str, Any]] = []
    answers_per_id: dict[str, int] = {}
    inflight: dict[asyncio.Future[Any], str] = {}
    skips: list[tuple[float, list[str]]] = []
    sent = 0
    period = 1.0 / fps

    async def one(i: int, t0: float) -> None:
        rid = f"demo-{i:05d}"
        k = i % len(inputs)
        sent_s = time.monotonic() - t0
        up = link_now()
        up_bps = 0.0 if up["outage"] else up["up_bps"]
        t = time.perf_counter()
        ans, err = await loop.run_in_executor(sender.pool, sender.send, inputs[k], rid)
        lat = (time.perf_counter() - t) * 1e3
        answers_per_id[rid] = answers_per_id.get(rid, 0) + 1
        if ans is None:
            records.append(Record(rid, k, sent_s, time.monotonic() - t0, "error", "", lat, float("nan"),
                                  up_bps, err, float("nan"), served="error"))
            return
        cut_id = ans.get("cut_id") or ""
        records.append(Record(rid, k, sent_s, time.monotonic() - t0, ans["served_by"], cut_id,
                              lat, float(ans.get("latency_ms") or 0.0), up_bps, ans.get("fallback_reason") or "",
                              _rel_err(ans["outputs"], refs[k]), ans.get("encoding") or "fp32",
                              served_as(ans["served_by"], cut_id, n_layers)))

    say(f"      {'t_s':>5} {'link (emulated)':>16} {'estimate':>10} {'plan in use':>22} "
        f"{'answers/s':>9} {'p50_ms':>7}  served (split/remote/local/local_tail)")
    start_trace()
    t0 = time.monotonic()
    next_tick, next_line, i, last_n = t0, t0 + 1.0, 0, 0
    try:
        while True:
            if stop():
                raise asyncio.CancelledError("stopped")
            now = time.monotonic()
            if now - t0 >= duration_s:
                break
            if now >= next_tick:
                next_tick += period
                if len(inflight) >= window:
                    skips.append((now - t0, sorted(inflight.values())))
                else:
                    fut = asyncio.ensure_future(one(i, t0))
                    inflight[fut] = f"demo-{i:05d}"
                    fut.add_done_callback(lambda f: inflight.pop(f, None))
                    i += 1
                    sent += 1
            if now >= next_line:
                next_line += 1.0
                last_n = _line(now - t0, records, last_n, link_now(), await status(), label_cut, timeline, say)
            await asyncio.sleep(max(0.0, min(next_tick, next_line) - time.monotonic()))
        if inflight:
            await asyncio.gather(*list(inflight))
        _line(time.monotonic() - t0, records, last_n, link_now(), await status(), label_cut, timeline, say)
    finally:
        for f in list(inflight):
            f.cancel()
        await loop.run_in_executor(None, sender.close)
    return StreamResult(sorted(records, key=lambda r: r.sent_s), timeline, sent, len(skips), answers_per_id,
                        time.monotonic() - t0, skips)


def _line(t_s: float, records: list[Record], last_n: int, link: dict[str, Any], st: dict[str, Any],
          label_cut: Callable[[str], str], timeline: list[dict[str, Any]], say: Callable[[str], None]) -> int:
    new = records[last_n:]
    link_est = st.get("link") or {}
    est = link_est.get("up_hold_bps") or link_est.get("up_bps")  # the rate plans use
    act = st.get("action") or {}
    plan = "local (edge-only)" if act.get("kind") == "local" else label_cut(act.get("cut_id") or "") if act else "-"
    lats = [r.latency_ms for r in new]
    p50 = float(np.median(lats)) if lats else float("nan")
    by = {k: sum(r.served == k for r in new) for k in (*SERVED_AS, "error")}
    link_s = "OUTAGE" if link["outage"] else f"{link['up_bps'] / 1e6:.2f} Mbit/s"
    est_s = f"{est / 1e6:.2f}M" if est else "-"
    extra = f" ({by['error']} errors)" if by["error"] else ""
    say(f"      {t_s:5.1f} {link_s:>16} {est_s:>10} {plan[:22]:>22} {len(new):>9} "
        f"{p50:7.0f}  {by['split']}/{by['remote']}/{by['local']}/{by['local_tail']}{extra}")
    timeline.append({"t_s": t_s, "link_up_bps": 0.0 if link["outage"] else link["up_bps"], "outage": link["outage"],
                     "est_up_bps": est, "plan": plan, "action_kind": act.get("kind"), "cut_id": act.get("cut_id"),
                     "reason": act.get("reason"), "breaker": st.get("breaker"), "answers": len(new),
                     "p50_ms": None if not lats else p50, **{f"n_{k}": v for k, v in by.items()}})
    return len(records)
