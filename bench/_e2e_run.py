"""One model of the e2e benchmark: profiles, strategies, the real stack and the measurements.

[Note: e2e measurement]
The edge is a child process (`bench._e2e_edge`) with one ONNX Runtime thread whose
work (heads, encodes) takes the device's slowdown times its CPU time (edge_agent.device,
[Note: time-scaled device]); the cloud is the gateway in this process (tails in-process, every
core); between them the user-space link emulator. For every link the seven strategies
pick a cut and an encoding ([Note: e2e strategies]), and the oracle's candidates are the
chain points (capped, evenly spaced, fp32) plus those picks; the oracle is the fastest
measured candidate whose agreement (`_agreement`) meets the budget. Every candidate that is measured runs `reps` requests
end to end on the device, one at a time and round-robin over the candidates (the host is
shared: a burst of load then hits every candidate alike); its latency is the median.
A candidate other than ours whose first request took over 3x the best first request
stops there (one sample, `n` says so; it cannot be the oracle). Ours and every candidate
whose median is within `_CLOSE` of the best then get `reps` more requests, round-robin,
so that near-ties (where the regret is decided) rest on twice the samples.

Candidates are measured best-predicted first. One is skipped, and counted as skipped,
only when a lower bound taken from measurements already loses: the larger of its
boundary's bytes over the emulated uplink and the fastest head run of that cut measured
on an earlier link (the head's compute does not depend on the link) exceeds
`prune_ratio` times the best request measured so far on that link. Neither bound is the
cost model, so pruning cannot hide a cut the model mispredicts. A baseline's pick is
always measured unless that bound exceeds `_PICK_BOUND` times the best (cloud-only at
0.13 Mbit/s: 37 s a request); its regret is then reported as the lower bound it is.

On the `load_mbps` links every distinct pick also gets the same Poisson arrivals at 1.2x
the best predicted throughput among the picks (`_measure_load`), for at most `_LOAD_MAX_S`
seconds of arrivals.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import onnx

__all__ = ["ModelRun", "run_model"]

logger = logging.getLogger(__name__)

_DOWN_RATIO = 4.0
_FAST_LINK = {"up_bps": 1e9, "down_bps": 1e9, "rtt_ms": 1.0}
# Poisson load offered at this multiple of the best predicted throughput (1 / bottleneck).
_LOAD_FACTOR = 1.2
# No new arrival after this many seconds of a load run (the config's "load_max_s"):
# edge-only VGG19 answers 0.37/s, so 40 arrivals would take 108 s to drain; 30 s of
# arrivals already show its rate.
_LOAD_MAX_S = 30.0
# A baseline's pick whose measured lower bound is this many times the best measured
# request on the link is not run; its regret is reported as at least bound / oracle.
_PICK_BOUND = 10.0
# Candidates whose median is within this factor of the best get a second round of requests.
_CLOSE = 1.25
# The gateway's timings of its own work on a request (cluster.server and the pool).
_SERVER_STAGES = ("decode", "decode_tensors", "queue", "compute", "encode")


class _GatewayThread:
    """The gateway (in-process pools) and its gRPC server on an event loop in a thread."""

    def __init__(self, registry_dir: str, cache_dir: str) -> None:
        self.registry_dir, self.cache_dir = registry_dir, cache_dir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="e2e-gateway", daemon=True)
        self.gateway: Any = None
        self.server: Any = None

    def _call(self, coro: Any, timeout_s: float = 300.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self) -> int:
        from cluster.gateway import Gateway, LocalPoolFactory
        from cluster.registry import Registry
        from cluster.server import serve

        self.thread.start()

        async def up() -> int:
            registry = Registry(self.registry_dir, cache_dir=self.cache_dir)
            self.gateway = Gateway(registry, LocalPoolFactory(cache_dir=self.cache_dir, provider="cpu"))
            await self.gateway.start()
            self.server = await serve(self.gateway, host="127.0.0.1", port=0)
            return int(self.server.port)

        return self._call(up())

    def stop(self) -> None:
        async def down() -> None:
            if self.server is not None:
                await self.server.stop(1.0)
            if self.gateway is not None:
                await self.gateway.close()

        try:
            self._call(down(), 60.0)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            logger.warning("stopping the gateway failed: %s", e)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10.0)


def _child_env() -> dict[str, str]:
    # The child runs `-m bench._e2e_edge`: bench/ is not installed, so its checkout goes first.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + (os.pathsep + path if path else ""))


class _Edge:
    """The edge child process: JSON lines in, JSON lines out."""

    def __init__(self, address: str, model: str, setup: dict[str, Any]) -> None:
        from splitinfer.emulate import die_with_parent

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench._e2e_edge", address, model, "1"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=None, start_new_session=True, text=True,
            env=_child_env(), preexec_fn=die_with_parent)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(setup) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline().strip()
        except BrokenPipeError:
            line = ""
        if line != "ready":
            self.close()
            raise RuntimeError(f"the edge child did not start (said {line!r}, exit code {self.proc.poll()})")
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def job(self, cand_id: str, precision: str, reps: int, *, check: bool = False) -> dict[str, Any]:
        """`reps` requests of the cut in the encoding keyed `precision`; with `check` the first
        answer's agreement with the whole model comes back as ``check_agreement``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        job = {"id": cand_id, "precision": precision, "reps": reps, "check": check}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the edge child exited (code {self.proc.poll()}) during {cand_id}")
        return json.loads(line)

    def load(self, cand_id: str, precision: str, rate_hz: float, n: int, max_s: float) -> dict[str, Any]:
        """Poisson arrivals at `rate_hz`, no new one after `max_s` (see `bench._e2e_edge._load`)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        job = {"op": "load", "id": cand_id, "precision": precision, "rate_hz": rate_hz, "n": n, "max_s": max_s}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the edge child exited (code {self.proc.poll()}) during the load on {cand_id}")
        return json.loads(line)

    def add(self, cand: dict[str, Any]) -> None:
        """Loads one more candidate's head in the child."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": "add", "candidate": cand}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line or "error" in json.loads(line):
            raise RuntimeError(f"the edge child could not load cut {cand['id']}: {line.strip()!r}")

    def close(self) -> None:
        import signal

        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _start_edge(address: str, model: str, setup: dict[str, Any], notes: list[str],
                say: Callable[[str], None], tries: int = 3) -> _Edge:
    """The edge child, started again (up to `tries` in all) when it dies before ``ready``;
    each failed start is kept in `notes`."""
    for attempt in range(1, tries + 1):
        try:
            return _Edge(address, model, setup)
        except RuntimeError as e:
            notes.append(f"edge child start {attempt} of {tries} failed: {e}")
            say(f"      {e}; " + ("starting it again" if attempt < tries else "giving up"))
            if attempt == tries:
                raise
            time.sleep(2.0 * attempt)
    raise AssertionError("unreachable")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tot = [r["total_ms"] for r in rows]
    return {
        "n": len(rows), "p50_ms": median(tot), "p95_ms": _pct(tot, 0.95),
        "edge_ms": median(r["edge_ms"] for r in rows), "encode_ms": median(r["encode_ms"] for r in rows),
        "remote_ms": median(r["remote_ms"] for r in rows), "wire_bytes": int(median(r["wire_bytes"] for r in rows)),
        "server_ms": {k: median(r["server"].get(k, 0.0) for r in rows)
                      for k in sorted({k for r in rows for k in r["server"]})},
    }


class _Exporter:
    """Head segments on disk and the child's description of each candidate cut."""

    def __init__(self, splitter: Any, heads_dir: str, notes: list[str]) -> None:
        self.splitter, self.heads_dir, self.notes = splitter, heads_dir, notes
        self.n = 0
        os.makedirs(heads_dir, exist_ok=True)

    def candidate(self, c: Any) -> dict[str, Any] | None:
        from partitioner import boundary

        graph = self.splitter.graph
        if not c.key.startswith("L"):
            self.notes.append(f"a cut with {len(c.device)} device layers has a hashed id the gateway cannot map; "
                              "not measured")
            return None
        local = len(c.device) == len(graph)
        head_path = None
        if c.device and not local:
            head, _ = self.splitter.split(c, check=False)
            self.n += 1
            head_path = os.path.join(self.heads_dir, f"head{self.n}.onnx")
            onnx.save_model(head.model, head_path)
        return {"id": c.key, "cut_key": c.key, "local": local, "head_path": head_path,
                "boundary": [] if local else list(boundary(graph, c))}


def _warm(edge: _Edge, cands: list[dict[str, Any]], notes: list[str]) -> set[str]:
    """One request per cut over the fast link: the gateway builds each tail on first use."""
    ok = set()
    for c in cands:
        if c["local"]:
            ok.add(c["id"])
            continue
        r = edge.job(c["id"], "fp32", 1)
        if "error" in r:
            notes.append(f"cut {c['id']} fails at the gateway ({r['error']}); not measured")
        else:
            ok.add(c["id"])
    return ok


def _probe_choice(cands: list[dict[str, Any]], known: set[str], empty_id: str, table: Any) -> tuple[str, str] | None:
    """The candidate and encoding a device's RTT probe is like ([Note: probed RTT]): the cut
    where the device runs no layer, so no head runs before the call, in the encoding with
    the fewest measured bytes there (the accuracy table's; ``int8`` where it measured none).
    None when that cut is not served."""
    cand = next((c for c in cands if c["id"] == empty_id and not c["local"] and c["id"] in known), None)
    if cand is None:
        return None
    sized = [e for e in (table.entries if table is not None else ()) if e.cut_id == empty_id and e.wire_bytes > 0
             and e.agreement is not None]
    return cand["id"], (min(sized, key=lambda e: e.wire_bytes).encoding if sized else "int8")


def _call_extra_ms(row: dict[str, Any], link: dict[str, float], out_bytes: float) -> float:
    """One request's call time beyond the gateway's own work, the link's RTT and the time of
    its bytes both ways on the link (``up_bps``, ``down_bps``, ``rtt_ms``)."""
    return (row["remote_ms"] - sum(row["server"].get(k, 0.0) for k in _SERVER_STAGES) - link["rtt_ms"]
            - row["wire_bytes"] * 8 / link["up_bps"] * 1e3 - out_bytes * 8 / link["down_bps"] * 1e3)


# A link is probed only where the probe's bytes take at most this long on its uplink.
_PROBE_MAX_UP_MS = 500.0


def _call_overhead_ms(edge: _Edge, emu: Any, graph: Any, cands: list[dict[str, Any]], known: set[str], table: Any,
                      links: list[tuple[float, float]], reps: int = 3) -> tuple[float, int]:
    """Median time of a call beyond the gateway's own work, the RTT and the bytes, over
    `reps` requests of `_probe_choice` on each link of the grid (those where its bytes take
    at most `_PROBE_MAX_UP_MS`, else the fastest), one request per job as every measured
    request is sent; and how many requests that median is over. The emulator is left on
    the fast link."""
    from partitioner import make_cut
    from splitinfer.netem import LinkSetting

    pick = _probe_choice(cands, known, make_cut(graph, []).key, table)
    if pick is None:
        return 0.0, 0
    entry = table.entry(pick[0], pick[1]) if table is not None else None
    probe_bytes = entry.wire_bytes if entry is not None else 0.0
    out_bytes = float(sum(graph.tensor[o].bytes_per_sample or 0 for o in graph.outputs))
    grid = [{"up_bps": u, "down_bps": u * _DOWN_RATIO, "rtt_ms": rtt} for u, rtt in links]
    probed = [lk for lk in grid if probe_bytes * 8 / lk["up_bps"] * 1e3 <= _PROBE_MAX_UP_MS]
    probed = probed or [max(grid, key=lambda lk: lk["up_bps"])]
    extra = []
    try:
        for lk in probed:
            emu.set(LinkSetting(**lk))
            for _ in range(reps):
                r = edge.job(pick[0], pick[1], 1)
                if "error" not in r:
                    extra += [_call_extra_ms(x, lk, out_bytes) for x in r["rows"]]
    finally:
        emu.set(LinkSetting(**_FAST_LINK))
    return (max(0.0, median(extra)) if extra else 0.0), len(extra)


def _device_as_requested(edge: _Edge, cands: list[dict[str, Any]], device: Any, reps: int = 7) -> tuple[Any, float | None]:
    """The device profile brought to the whole model's median time over `reps` edge-only
    requests of the edge child, one request per job as every measured request is sent,
    and that median (None, and the profile unchanged, where no edge-only cut is served).

    [Note: device speed as requested]
    The device profile is the per-layer profile of one thread stretched by the slowdown, and
    a layer's time under ONNX Runtime's profiler is not its share of a whole run (the
    session's own work between nodes is in neither). A device learns its speed from its own
    runs (the agent's corrections do); here the planner gets it from the same requests the
    grid measures."""
    local = next((c for c in cands if c["local"]), None)
    ms: list[float] = []
    for _ in range(reps if local is not None else 0):
        r = edge.job(local["id"], "fp32", 1)  # type: ignore[index]
        if "error" not in r:
            ms += [x["edge_ms"] for x in r["rows"]]
    return _scaled_to(device, ms)


def _scaled_to(device: Any, whole_ms: list[float]) -> tuple[Any, float | None]:
    """`device` with every time stretched so the whole model takes the median of
    `whole_ms`, and that median; the profile unchanged and None where `whole_ms` is empty."""
    from splitinfer.demo.setup import slow_down

    if not whole_ms:
        return device, None
    total = sum(t.ms for t in device.layers.values()) + device.fixed_ms
    return slow_down(device, median(whole_ms) / max(total, 1e-6), f"{device.device}-as-requested"), median(whole_ms)


def _codec_on_edge(edge: _Edge, graph: Any, cands: list[dict[str, Any]], table: Any,
                   slowdown: float, fixed_ms: float = 0.0, reps: int = 5) -> tuple[Any, dict[str, Any]]:
    """The accuracy table with its lossy codecs priced at the edge's speed: a codec of the
    model input at the median encode ms of `reps` requests over the fast link, round-robin
    over the input codecs, less the device's `fixed_ms` per tensor sent, which the cost model adds (where that exceeds the
    table's encode + decode ms), a codec of a feature map at the table's time times the
    device's `slowdown`. Returns the table and, per input codec, both figures.

    [Note: codec time on the device]
    ``splitinfer calibrate`` times each codec on the host that calibrates (one thread at
    full speed), and the cost model counts that time on the sender. The sender is the
    emulated device, its work stretched by the slowdown, so each input codec is timed on the
    edge itself, and the feature-map codecs, too many to time at every cut, take the
    slowdown times the table's time. Priced at the table's time, a tiled JPEG of
    SqueezeNet's first layer (64 channels of 111x111) looked cheap at 100 Mbit/s and took
    187 ms against the fp16 input's 76 ms. The grid's requests go round-robin over the
    candidates, so the codecs are timed round-robin too: timed back to back, each codec
    warm from the request before, a tiled JPEG of SqueezeNet's input read 7.7 ms and took
    10.6 ms in the grid (ours answered in 36.5 ms against int8's 32.7); round-robin it
    reads 10.7 ms."""
    from dataclasses import replace

    from bench._e2e_codec import timed_round_robin
    from partitioner import make_cut
    from planner.accuracy import parse_encoding_key

    empty = make_cut(graph, []).key
    cand = next((c for c in cands if c["id"] == empty), None)
    priced, at_input = [], []
    for e in table.entries:
        if e.agreement is None or e.codec_ms <= 0 or parse_encoding_key(e.encoding)[1] is None:
            continue
        if e.cut_id != empty:
            priced.append(replace(e, codec_ms=e.codec_ms * slowdown))
        elif cand is not None:
            at_input.append(e)
    seen: dict[str, Any] = {}
    if cand is None or not at_input:
        return table.with_entries(priced), seen
    ms = timed_round_robin(edge, cand["id"], [e.encoding for e in at_input], reps)
    for e in at_input:
        if not ms[e.encoding]:
            continue
        edge_ms = median(ms[e.encoding]) - fixed_ms * len(cand["boundary"])
        seen[e.encoding] = {"table_ms": e.codec_ms, "edge_ms": edge_ms}
        if edge_ms > e.codec_ms:
            priced.append(replace(e, codec_ms=edge_ms))
    return table.with_entries(priced), seen


def _layers(key: str) -> list[int]:
    from partitioner import Cut

    c = Cut.from_key(key)
    return [] if c is None else sorted(c.device)


class ModelRun:
    """What `run_model` measured for one model (plain dicts, ready for JSON)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.setup: dict[str, Any] = {}
        self.links: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.name, "setup": self.setup, "links": self.links, "notes": self.notes}


def _agreement(graph: Any, cut: Any, enc: Any, table: Any) -> float | None:
    """A cut and encoding's agreement with the fp32 model: 1 for fp32 and for edge-only
    (nothing crosses), else the accuracy table's ([Note: accuracy budget] in planner.budget)."""
    if enc.lossless or len(cut.device) == len(graph):
        return 1.0
    return None if table is None else table.agreement(cut, enc)


def _strategies(graph: Any, profiles: list[Any], link: Any, table: Any,
                min_agreement: float) -> dict[str, tuple[Any, Any] | None]:
    """Each strategy's cut and encoding on `link`; None where it has no plan (no JPEG
    quality meets the budget, or the input is no image).

    [Note: e2e strategies]
    Neurosurgeon and DADS are as published: fp32 boundaries. ``dads_encoded`` is DADS's
    min-cut given our casts (fp16, int8) within the budget, at the cuts where the
    accuracy table measured them: it separates the planner's win from the encoding's.
    ``cloud_only_jpeg`` is what a camera app deploys: the frame as a JPEG, at the
    quality (of the table's) that meets the budget and the cost model finds fastest.
    ``ours`` is `planner.solve_within_budget` with every cast and the table's lossy
    codecs (JPEG/WebP of the input, tiled feature maps, bit depths)."""
    from partitioner import make_cut
    from planner import Encoding, solve, solve_chain_scan
    from planner.budget import best_codec, lossy_encoding, solve_within_budget

    fp32 = Encoding()
    casts = (fp32, Encoding("fp16"), Encoding("int8"))
    ours = solve_within_budget(graph, profiles, link, "latency", encodings=(*casts, Encoding("int8", per_channel=True)),
                               accuracy=table, min_agreement=min_agreement)
    dads_enc = solve_within_budget(graph, profiles, link, "latency", encodings=casts, accuracy=table,
                                   min_agreement=min_agreement, codecs=())
    jpeg = best_codec(graph, profiles, link, table, min_agreement, codecs=("jpeg",))
    jpeg_pick = None
    if jpeg is not None:
        cut = make_cut(graph, _layers(jpeg.cut_id))
        enc = lossy_encoding(graph, cut, table.entry(jpeg.cut_id, jpeg.encoding))
        jpeg_pick = (cut, enc) if enc is not None else None
    return {
        "edge-only": (make_cut(graph, range(len(graph))), fp32),
        "cloud-only": (make_cut(graph, []), fp32),
        "neurosurgeon": (solve_chain_scan(graph, profiles, link, "latency").cuts[0], fp32),
        "dads": (solve(graph, profiles, link, "latency", encodings=(fp32,)).cuts[0], fp32),
        "dads_encoded": (dads_enc.cuts[0], dads_enc.encoding),
        "cloud_only_jpeg": jpeg_pick,
        "ours": (ours.cuts[0], ours.encoding),
    }


def run_model(name: str, work_dir: str, *, links: list[tuple[float, float]], reps: int, max_chain: int,
              slowdown: float | None, profile_runs: int, prune_ratio: float = 1.5, load_mbps: tuple[float, ...] = (),
              load_n: int = 0, min_agreement: float = 0.99, calibrate_chain: int = 6,
              say: Callable[[str], None] = print) -> ModelRun:
    """Profiles `name` (a zoo or a real-weight model), measures its accuracy table
    (``splitinfer calibrate``, cached), starts the stack and measures every strategy and
    the oracle within the `min_agreement` budget on each link."""
    from bench._e2e_codec import casts_on_edge
    from bench._e2e_real import calibrate, is_real, prepare_real, zoo_samples_path
    from partitioner import Splitter, chain_points, make_cut, prefix_cut
    from planner import Link
    from splitinfer.demo.setup import prepare
    from splitinfer.netem import LinkSetting, ThreadedLinkEmulator

    out = ModelRun(name)
    t0 = time.monotonic()
    real = is_real(name)
    dm = (prepare_real if real else prepare)(name, work_dir, runs=profile_runs, slowdown=slowdown,
                                             say=say)
    graph, profiles = dm.graph, [dm.device, dm.cloud]
    samples_path = dm.samples_path if real else zoo_samples_path(dm, work_dir)
    table = calibrate(dm, samples_path, max_chain_points=calibrate_chain, say=say)
    model_scale = dm.edge_model_ms / max(float(dm.emulation.get("one_thread_ms") or dm.edge_model_ms), 1e-6)
    out.setup = {"edge": f"1 ORT thread, its work stretched {dm.device_slowdown:.3g}x in time "
                         f"(from the {dm.emulation.get('slowdown_from', 'reference ratio')})",
                 "device_slowdown": dm.device_slowdown,
                 "cloud": "gateway in-process pool, every core", "edge_model_ms_profile": dm.edge_model_ms,
                 "cloud_model_ms": dm.cloud_model_ms, "profile_source": dm.profile_source,
                 "layers": len(graph), "gflops": graph.total_flops / 1e9, "reps": reps,
                 "prune_ratio": prune_ratio, "real_weights": real,
                 "weights": "real (PyPI wheel)" if real else "seeded random (onnx zoo topology)",
                 "inputs": ("realistic samples (bench._wild_models)" if real
                            else "smooth colour images (splitinfer calibrate's generated samples)"),
                 "accuracy_table": {"entries": len(table.entries), "num_samples": table.num_samples,
                                    "sample_source": table.sample_source, "cuts": len(table.cut_ids)},
                 "edge_over_one_thread": model_scale}
    chain = list(chain_points(graph))
    if len(chain) > max_chain:
        step = len(chain) / max_chain
        kept = sorted({chain[int(i * step)] for i in range(max_chain)} | {chain[-1]})
        out.notes.append(f"oracle candidates: {len(kept)} of {len(chain)} chain points (evenly spaced) "
                         "plus the strategies' picks")
        chain = kept
    cuts = {c.key: c for c in [make_cut(graph, []), make_cut(graph, range(len(graph)))]}
    cuts.update((c.key, c) for c in (prefix_cut(graph, v) for v in chain))
    export = _Exporter(Splitter(dm.model, graph), os.path.join(work_dir, "heads"), out.notes)
    cands = [c for c in (export.candidate(c) for c in cuts.values()) if c is not None]
    gw = _GatewayThread(dm.registry_dir, os.path.join(work_dir, "gateway-cache"))
    emu = None
    edge = None
    try:
        port = gw.start()
        emu = ThreadedLinkEmulator(upstream=("127.0.0.1", port), setting=LinkSetting(**_FAST_LINK)).start()
        edge = _start_edge(f"127.0.0.1:{emu.port}", name, {"model_path": dm.model_path, "candidates": cands,
                                                            "seed": 0, "inputs_path": samples_path,
                                                            "slowdown": dm.device_slowdown}, out.notes, say)
        known = _warm(edge, cands, out.notes)
        profiles[0], out.setup["edge_model_ms"] = _device_as_requested(edge, cands, profiles[0])
        if out.setup["edge_model_ms"] is None:
            out.setup["edge_model_ms"] = dm.edge_model_ms
        profiles[0], out.setup["casts_on_edge"] = casts_on_edge(edge, graph, cands, known, profiles[0])
        overhead_ms, out.setup["call_overhead_requests"] = _call_overhead_ms(edge, emu, graph, cands, known, table,
                                                                             links)
        out.setup["call_overhead_ms"] = overhead_ms
        # the planner prices the input's codecs at the edge's speed ([Note: codec time on the device])
        plan_table, out.setup["codec_ms_on_edge"] = _codec_on_edge(edge, graph, cands, table, dm.device_slowdown,
                                                                   profiles[0].codec.encode_fixed_ms)
        say(f"      stack up (gateway :{port}, emulator :{emu.port}) in {time.monotonic() - t0:.0f} s; "
            f"a call's fixed cost beyond RTT and bytes: {overhead_ms:.1f} ms")
        # [Note: probed RTT] The planner gets the link as a device would estimate it: the
        # rate, and the RTT its probes see (the emulated RTT plus this stack's fixed cost
        # per call: gRPC, the proxy, the gateway's decode and queue, and the edge's own CPU
        # work of a call), measured before any link of the grid is
        # measured. A probe is a small call with no head before it, sent on the links of
        # the grid: the cut where the device runs nothing, in the fewest bytes measured
        # there (`_probe_choice`), a few requests per link, their median over all links.
        # The probes go over the grid's own links, as the measured requests do.
        plan_links = [Link(up_bps=u, down_bps=u * _DOWN_RATIO, rtt_ms=rtt + overhead_ms) for u, rtt in links]
        picks = [_strategies(graph, profiles, lk, plan_table, min_agreement) for lk in plan_links]
        fresh = {c.key: c for p in picks for c, _ in (v for v in p.values() if v is not None) if c.key not in cuts}
        for c in (export.candidate(c) for c in fresh.values()):
            if c is not None:
                edge.add(c)
                known |= _warm(edge, [c], out.notes)
                cands.append(c)
        out.setup["candidate_cuts"] = len(cands)
        edge_floor: dict[str, float] = {}
        say(f"      {len(cands)} candidate cuts ({len(chain)} chain points + the strategies' picks)")
        for (u, rtt), lk, pk in zip(links, plan_links, picks):
            emu.set(LinkSetting(up_bps=u, down_bps=u * _DOWN_RATIO, rtt_ms=rtt))
            row = _measure_link(graph, profiles, lk, pk, chain, known, edge, reps=reps, prune_ratio=prune_ratio,
                                edge_floor=edge_floor, table=table, min_agreement=min_agreement, say=say)
            row["rtt_ms"], row["planner_rtt_ms"] = rtt, lk.rtt_ms
            if load_n and any(abs(u - x * 1e6) < 1 for x in load_mbps):
                row["load"] = _measure_load(graph, profiles, lk, pk, known, edge, n=load_n, say=say)
            out.links.append(row)
    finally:
        if edge is not None:
            edge.close()
        if emu is not None:
            emu.stop()
        gw.stop()
    out.setup["wall_s"] = time.monotonic() - t0
    return out


def _key(enc: Any) -> str:
    from planner.accuracy import encoding_key

    return encoding_key(enc)


def _wire_scale(enc: Any) -> float:
    """Wire bytes per float32 byte of the boundary under `enc` (a lossy codec's measured ratio)."""
    if enc.lossy_codec:
        return float(enc.ratio or 1.0)
    return {"fp32": 1.0, "fp16": 0.5, "int8": 0.25}[enc.precision]


def _measure_load(graph: Any, profiles: list[Any], lk: Any, picks: dict[str, tuple[Any, Any] | None], known: set[str],
                  edge: _Edge, *, n: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Every distinct pick under the same Poisson load: 1.2x the best predicted throughput."""
    from planner import evaluate

    keys: dict[tuple[str, str], list[str]] = {}
    period: dict[tuple[str, str], float] = {}
    for sname, pick in picks.items():
        if pick is None:
            continue
        c, enc = pick
        k = (c.key, _key(enc))
        if k[0] in known:
            keys.setdefault(k, []).append(sname)
            period[k] = evaluate(graph, c, profiles, lk, enc).period_ms
    rate_hz = _LOAD_FACTOR * max(1000.0 / max(p, 1e-3) for p in period.values())
    res: dict[str, Any] = {"offered_hz": rate_hz, "n": n, "strategies": {}}
    for k, names in keys.items():
        r = edge.load(k[0], k[1], rate_hz, n, _LOAD_MAX_S)
        lat = r.get("latency_ms") or [float("nan")]
        row = {"cut_id": k[0], "encoding": k[1], "predicted_hz": 1000.0 / max(period[k], 1e-3),
               "achieved_hz": r["answered"] / r["span_s"] if r.get("answered") else 0.0,
               "sent": r.get("sent", n), "answered": r.get("answered", 0), "p50_ms": _pct(lat, 0.5),
               "p95_ms": _pct(lat, 0.95),
               "errors": r.get("errors", r.get("error"))}
        for name in names:
            res["strategies"][name] = row
    o = res["strategies"].get("ours")
    say(f"      load at {lk.up_bps / 1e6:g} Mbit/s, {rate_hz:.2f} req/s offered: " + ", ".join(
        f"{s} {v['achieved_hz']:.2f}/s" for s, v in res["strategies"].items()) + ("" if o else " (ours not run)"))
    return res


def _measure_link(graph: Any, profiles: list[Any], lk: Any, picks: dict[str, tuple[Any, Any] | None],
                  chain: list[int], known: set[str], edge: _Edge, *, reps: int, prune_ratio: float,
                  edge_floor: dict[str, float], table: Any, min_agreement: float,
                  say: Callable[[str], None]) -> dict[str, Any]:
    """Measures the picks and the chain points on one link; `edge_floor` (cut id -> fastest
    head run seen) carries over from link to link. Every candidate carries its agreement
    (`_agreement`) and the oracle is the fastest measured one within `min_agreement`."""
    from partitioner import boundary_bytes, prefix_cut
    from planner import Encoding, evaluate

    todo: dict[tuple[str, str], tuple[Any, Any]] = {}
    for pick in picks.values():
        if pick is not None:
            todo[(pick[0].key, _key(pick[1]))] = pick
    for v in chain:
        c = prefix_cut(graph, v)
        todo.setdefault((c.key, "fp32"), (c, Encoding()))
    pred = {k: evaluate(graph, c, profiles, lk, enc) for k, (c, enc) in todo.items()}
    pick_keys = {(p[0].key, _key(p[1])) for p in picks.values() if p is not None}
    ours_key = (picks["ours"][0].key, _key(picks["ours"][1]))  # type: ignore[index]
    order = sorted(todo, key=lambda k: (k not in pick_keys, pred[k].total_ms))
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    checks: dict[tuple[str, str], float | None] = {}
    skipped = 0
    bounded: dict[tuple[str, str], float] = {}
    best = float("inf")
    for k in order:  # one request each, best predicted first, so the bound prunes early
        c, enc = todo[k]
        if k[0] not in known:
            continue
        full = len(c.device) == len(graph)
        floor_ms = 0.0 if full else boundary_bytes(graph, c) * _wire_scale(enc) * 8 / lk.up_bps * 1e3
        floor_ms = max(floor_ms, edge_floor.get(k[0], 0.0))
        if k != ours_key and floor_ms > (prune_ratio if k not in pick_keys else _PICK_BOUND) * best:
            if k in pick_keys:
                bounded[k] = floor_ms
            else:
                skipped += 1
            continue
        # the first request of every pick is checked against the whole model on the same input
        r = edge.job(k[0], k[1], 1, check=k in pick_keys)
        if "error" in r:
            logger.warning("cut %s (%s) failed: %s", k[0], k[1], r["error"])
            continue
        rows[k] = r["rows"]
        checks[k] = r.get("check_agreement")
        best = min(best, r["rows"][0]["total_ms"])
    # The other requests go round-robin over the candidates, so a burst of load from
    # elsewhere on the host lands on all of them alike rather than on one cut's run.
    # A candidate already 3x slower than the best in its first request gets no more
    # (ours always does): its regret is plain from one sample, and at 0.13 Mbit/s one
    # cloud-only request alone takes 37 s.
    again = [k for k in rows if k == ours_key or rows[k][0]["total_ms"] <= 3 * best]
    for _ in range(reps - 1):
        for k in again:
            r = edge.job(k[0], k[1], 1)
            if "error" not in r:
                rows[k].extend(r["rows"])
    # Where the regret is decided, `reps` more rounds: ours and every candidate whose
    # median is within `_CLOSE` of the best median, so a near-tie is not settled by noise.
    if reps > 1:
        best_p50 = min(median(x["total_ms"] for x in rs) for rs in rows.values())
        close = [k for k in again if k == ours_key or median(x["total_ms"] for x in rows[k]) <= _CLOSE * best_p50]
        for _ in range(reps if len(close) > 1 else 0):
            for k in close:
                r = edge.job(k[0], k[1], 1)
                if "error" not in r:
                    rows[k].extend(r["rows"])
    measured: dict[tuple[str, str], dict[str, Any]] = {}
    for k, rs in rows.items():
        c, enc = todo[k]
        s = _summary(rs)
        edge_floor[k[0]] = min(edge_floor.get(k[0], float("inf")), min(r["edge_ms"] for r in rs))
        b = pred[k]
        s.update({"cut_id": k[0], "encoding": k[1], "device_layers": len(c.device),
                  "agreement": _agreement(graph, c, enc, table), "check_agreement": checks.get(k),
                  "predicted_ms": b.total_ms, "predicted": {"edge_ms": b.edge_ms, "encode_ms": b.encode_ms,
                                                            "uplink_ms": b.uplink_ms, "rtt_ms": b.rtt_ms,
                                                            "cloud_ms": b.cloud_ms, "downlink_ms": b.downlink_ms}})
        measured[k] = s
    strategies: dict[str, Any] = {}
    for sname, pick in picks.items():
        if pick is None:
            strategies[sname] = {"cut_id": None, "encoding": None, "measured": None, "agreement": None,
                                 "not_applicable": "no JPEG quality of the accuracy table meets the budget "
                                                   "(or the input is no image)"}
            continue
        c, enc = pick
        k = (c.key, _key(enc))
        m = measured.get(k)
        strategies[sname] = {"cut_id": c.key, "encoding": k[1], "device_layers": len(c.device),
                             "agreement": _agreement(graph, c, enc, table), "measured": m}
        if k in bounded:
            strategies[sname]["lower_bound_ms"] = bounded[k]
    within = {k: v for k, v in measured.items() if v["agreement"] is not None and v["agreement"] >= min_agreement}
    okey = min(within or measured, key=lambda k: measured[k]["p50_ms"])
    oracle = measured[okey]
    row = {"up_bps": lk.up_bps, "down_bps": lk.down_bps, "rtt_ms": lk.rtt_ms, "strategies": strategies,
           "oracle": {"cut_id": okey[0], "encoding": okey[1], "p50_ms": oracle["p50_ms"],
                      "device_layers": oracle["device_layers"], "agreement": oracle["agreement"],
                      "within_budget": bool(within)},
           "candidates": list(measured.values()), "skipped_by_bound": skipped}
    ours = strategies["ours"]["measured"]
    say(f"      {lk.up_bps / 1e6:g} Mbit/s (planner's RTT {lk.rtt_ms:.1f} ms): ours {ours['p50_ms'] if ours else float('nan'):.0f} ms "
        f"({strategies['ours']['device_layers']} layers on device, {strategies['ours']['encoding']}, agreement "
        f"{strategies['ours']['agreement']:.3f}), oracle within the budget {oracle['p50_ms']:.0f} ms "
        f"({oracle['device_layers']} layers, {okey[1]}), {len(measured)} measured, {skipped} skipped by the "
        "bytes/rate bound")
    return row
