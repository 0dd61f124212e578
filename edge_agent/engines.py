"""The device's engines: the whole model (local fallback) and, per frontier cut, a head and
a local tail, all kept warm; plus the device profile and the plan frontier.

[Note: device profile]
`workers.profile` (the measured per-layer profiler) is outside the edge agent's
allowed imports, so on first start, when no `device_profile` file exists, the agent
writes a FLOPs-based estimate calibrated by timing the whole model here: layer ms =
FLOPs / (model FLOPs / measured model ms). It is cached and reused; replace it with a
measured profile for better plans.
[Note: cloud profile] When the gateway ships profiles/cloud.json the frontier uses it;
otherwise the cloud is assumed `CLOUD_SPEEDUP` times faster than this device (stated in
the log), which only decides how much the agent offloads, never correctness.
[Note: agent accuracy budget] The budget is the stricter of edge.yaml's `min_agreement`
and the one model.yaml set (frontier.json carries it). Under a budget the frontier is
planned on the accuracy.json the gateway ships (`planner.accuracy.AccuracyTable`): the
configured encodings where their measured agreement meets it, and the lossy codecs the
table measured at their cuts (planner [Note: accuracy budget]), their codec times brought
to this device's speed (planner.accuracy, [Note: codec time on the sender]). Without a
table only lossless plans meet a budget.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edge_agent.cache import ArtifactCache
from edge_agent.device import REFERENCE_RUNS, SlowDevice, SlowedEngine
from edge_agent.errors import ArtifactError
from partitioner import Cut, LayerGraph, PartitionError, Splitter, save_segment
from planner import Encoding, Frontier, LinkRange, PlannerError, Profile, frontier, make_flops_profile
from planner.accuracy import AccuracyTable
from workers.engine import Engine, EngineConfig
from workers.errors import WorkerError

__all__ = ["CutEngines", "ModelSet", "estimate_profile", "load_or_estimate_profile", "make_frontier",
           "CLOUD_SPEEDUP", "DEFAULT_LINK_RANGE", "profile_model_ms", "time_engine_ms"]

logger = logging.getLogger(__name__)

CLOUD_SPEEDUP = 10.0
DEFAULT_LINK_RANGE = LinkRange(0.5e6, 1e9, down_ratio=4.0, rtt_ms=20.0)
LOWEST_RTT_MS = 1.0
"""The lowest RTT a device sees to its cloud (a LAN): the agent's frontier is planned at it
([Note: frontier at the lowest RTT])."""
_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32, "uint8": np.uint8,
       "int8": np.int8, "bool": np.bool_, "float64": np.float64}


@dataclass
class CutEngines:
    """What the device runs for one offload cut."""

    cut_id: str
    head: Engine | None
    """None for the empty cut (the device sends the model inputs)."""
    tail: Engine
    """The cut's tail, for finishing locally when the cloud does not answer."""
    boundary: tuple[str, ...]
    """Tensors sent (the tail's inputs), in the tail's order."""
    head_model_outputs: tuple[str, ...]
    """Model outputs the head computes (they never travel)."""


def _zeros(engine: Engine) -> dict[str, np.ndarray]:
    return {s.name: np.zeros(tuple(d or 1 for d in s.shape), _NP.get(s.dtype, np.float32)) for s in engine.inputs}


def time_engine_ms(engine: Engine, runs: int = 5, *, clock: str = "wall") -> float:
    """Median ms of `runs` runs on zero inputs: elapsed (`clock` 'wall'), or the calling
    thread's CPU time ('thread': a one-thread run's own cost, whatever else the host runs)."""
    now = time.perf_counter if clock == "wall" else time.thread_time
    x = _zeros(engine)
    times = []
    for _ in range(runs):
        t = now()
        engine.run(x)
        times.append((now() - t) * 1e3)
    return float(np.median(times))


def estimate_profile(graph: LayerGraph, model_ms: float) -> Profile:
    """See [Note: device profile]."""
    flops = max(graph.total_flops, 1)
    gflops = flops / (max(model_ms, 1e-3) / 1e3) / 1e9
    # the one timed run is spread over the layers of known FLOPs; the others get none of it
    return make_flops_profile(graph, device=f"{socket.gethostname()}-flops-estimate", gflops=gflops,
                              unknown_flops_ms=0.0)


def profile_model_ms(profile: Profile, graph: LayerGraph) -> float:
    """The whole model's ms on the device as `profile` predicts it (see planner [Note: segment time])."""
    return profile.scale * sum(profile.layer_ms(layer.id) for layer in graph.layers) + profile.segment_const_ms


def load_or_estimate_profile(path: str, graph: LayerGraph, full: Engine) -> tuple[Profile, str]:
    """(profile, 'file'|'estimated'): the file at `path`, or an estimate written there."""
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as fh:
                return Profile.from_json(fh.read()), "file"
        except (OSError, ValueError, PlannerError) as e:
            raise ArtifactError(path=path, reason=f"is not a usable device profile ({e})",
                                fix="fix it, or delete it so the agent estimates a new one") from e
    prof = estimate_profile(graph, time_engine_ms(full))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(prof.to_json())
    os.replace(path + ".tmp", path)
    logger.info("estimated the device profile from FLOPs and one timed model run; wrote %s", path)
    return prof, "estimated"


def _accuracy_table(files: Mapping[str, bytes]) -> AccuracyTable | None:
    text = files.get("accuracy.json")
    if text is None:
        return None
    try:
        return AccuracyTable.from_json(text.decode("utf-8"))
    except (UnicodeDecodeError, PlannerError, KeyError, TypeError, ValueError) as e:
        logger.warning("ignoring the gateway's accuracy.json (%s): under a budget only lossless plans remain", e)
        return None


def make_frontier(graph: LayerGraph, device: Profile, files: Mapping[str, bytes], objective: str,
                  encodings: tuple[str, ...] = ("fp32", "fp16"), *, min_agreement: float | None = None) -> Frontier:
    """The plan frontier for this device; see [Note: cloud profile] and [Note: agent accuracy budget]
    (``min_agreement`` is edge.yaml's)."""
    cloud_text = files.get("profiles/cloud.json")
    if cloud_text is not None:
        cloud = Profile.from_json(cloud_text.decode())
    else:
        dev_ms = sum(device.layer_ms(layer.id) for layer in graph.layers)
        gflops = max(graph.total_flops, 1) / (max(dev_ms, 1e-3) / 1e3) / 1e9 * CLOUD_SPEEDUP
        cloud = make_flops_profile(graph, device="cloud-estimate", gflops=gflops, unknown_flops_ms=0.0)  # as the device's
        logger.info("no profiles/cloud.json from the gateway: assuming the cloud is %.0fx this device", CLOUD_SPEEDUP)
    rng = DEFAULT_LINK_RANGE
    registry_budget = None
    fj = files.get("frontier.json")
    if fj is not None:
        try:
            front_json = json.loads(fj)
            planner_part = front_json.get("planner")
            if planner_part:
                rng = LinkRange.from_dict(planner_part["link_range"])
            registry_budget = front_json.get("min_agreement")
        except (ValueError, KeyError, TypeError, AttributeError, PlannerError) as e:
            logger.warning("ignoring the link range of frontier.json (%s)", e)
    # [Note: frontier at the lowest RTT]
    # A remote plan pays the link's RTT once, whatever its cut, so the RTT does not change
    # which remote plan is best at a rate: it moves only where remote beats local. The
    # policy prices every remote option at the RTT it measures (policy._time_terms), so the
    # frontier must hold each remote plan that is best at some rate for any RTT the device
    # may see, and the frontier at the lowest RTT holds them all. It is then stated at the
    # registry's RTT, so that a plan is priced as the registry planned it until the first
    # RTT sample. SqueezeNet on an rpi4 against a t4: at 20 ms the frontier lacks layers
    # 0-20, which beat local and every other plan from 7.7 to 27.8 Mbit/s at a 1 ms RTT.
    stated, rng = rng, dataclasses.replace(rng, rtt_ms=min(rng.rtt_ms, LOWEST_RTT_MS))
    obj = "energy" if objective == "energy" else "latency"
    encs = tuple(Encoding(e) for e in encodings)
    budgets = [b for b in (min_agreement, registry_budget)
               if isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b <= 1]
    if not budgets:
        return _stated_at(frontier(graph, [device, cloud], rng, obj, encodings=encs), stated)
    budget = max(budgets)
    table = _accuracy_table(files)
    if table is not None:  # its codec times at this device's speed ([Note: codec time on the sender])
        table = table.priced_for(profile_model_ms(device, graph))
    logger.info("planning within min_agreement %g (edge.yaml %s, model.yaml %s) on %s", budget, min_agreement,
                registry_budget, "the gateway's accuracy.json" if table is not None else "no accuracy table")
    return _stated_at(frontier(graph, [device, cloud], rng, obj, encodings=encs, accuracy=table,
                               min_agreement=budget), stated)


def preloaded_cuts(files: Mapping[str, bytes]) -> frozenset[str] | None:
    """The cut ids whose tails the gateway preloads (frontier.json's `cuts`); None when it sent no
    readable frontier.json, which says nothing of what it loaded ([Note: cuts the gateway has not
    loaded] in probing.py)."""
    text = files.get("frontier.json")
    if text is None:
        return None
    try:
        return frozenset(str(c["cut_id"]) for c in json.loads(text)["cuts"])
    except (KeyError, ValueError, TypeError) as e:
        logger.warning("ignoring the cuts of frontier.json (%s: %s)", type(e).__name__, e)
        return None


def _stated_at(front: Frontier, rng: LinkRange) -> Frontier:
    """`front` with its link range, and each plan's link and breakdown, at `rng` (another RTT)."""
    if front.link_range == rng:
        return front
    moved = dataclasses.replace(front, link_range=rng)
    entries = tuple(dataclasses.replace(e, plan=dataclasses.replace(moved, entries=(e,)).plan_at(e.plan.link.up_bps))
                    for e in front.entries)
    return dataclasses.replace(moved, entries=entries)


class ModelSet:
    """The whole model and the per-cut engines of one model version on this device."""

    def __init__(self, model_path: str, *, cache: ArtifactCache, model: str, version: str,
                 intra_op_threads: int = 0, device: SlowDevice | None = None) -> None:
        self.model, self.version, self.cache = model, version, cache
        self.device = device or SlowDevice()
        """Every engine's runs take this device's time ([Note: time-scaled device])."""
        self.engine_config = EngineConfig(intra_op_threads=intra_op_threads, batch_buckets=(1,), dynamic_batch=False,
                                          cache_dir=cache.engines_dir, provider="auto")
        try:
            self.splitter = Splitter(model_path)
        except (PartitionError, OSError, ValueError) as e:
            raise ArtifactError(path=model_path, reason=f"is not a model the partitioner can read ({e})",
                                fix="re-export the model, or delete the cache so it is downloaded again") from e
        except Exception as e:  # onnx raises DecodeError and friends for a corrupt file
            raise ArtifactError(path=model_path, reason=f"cannot be parsed as ONNX ({type(e).__name__})",
                                fix="delete the cached model so it is downloaded again") from e
        self.graph = self.splitter.graph
        self.full = self._engine(model_path, f"{model}@{version}/full")
        self.cuts: dict[str, CutEngines] = {}
        self.local_ms = time_engine_ms(self.full)

    def _engine(self, path: str, name: str) -> Engine:
        try:
            return SlowedEngine(Engine(path, self.engine_config, name=name), self.device)  # type: ignore[return-value]
        except WorkerError as e:
            raise ArtifactError(path=path, reason=f"cannot be loaded by ONNX Runtime ({e})",
                                fix="delete the cache so the model is downloaded and cut again") from e

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.full.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.full.outputs)

    def load_cut(self, cut: Cut) -> CutEngines | None:
        """Warm the head and local tail of `cut` (cut once and cached as files); None for an edge-only cut."""
        if len(cut.device) >= len(self.graph):
            return None
        if cut.key in self.cuts:
            return self.cuts[cut.key]
        if not cut.device:
            # The empty cut's tail is the whole model, already loaded: one copy of its weights, and
            # one reference time on the emulated device ([Note: time-scaled device]).
            ce = CutEngines(cut.key, None, self.full, self.input_names, ())
            self.cuts[cut.key] = ce
            return ce
        paths = {k: self.cache.segment_path(self.model, self.version, cut.key, k) for k in ("head", "tail")}
        meta_path = os.path.join(os.path.dirname(paths["tail"]), "cut.json")
        if not (os.path.exists(paths["tail"]) and os.path.exists(meta_path)):
            head, tail = self.splitter.split(cut)
            os.makedirs(os.path.dirname(paths["tail"]), exist_ok=True)
            if head.layers:
                save_segment(head, paths["head"])
            save_segment(tail, paths["tail"])
            meta = {"edge_layers": sorted(cut.device), "boundary": list(tail.inputs),
                    "head_outputs": list(head.outputs)}
            with open(meta_path, "w", encoding="utf-8") as fh:
                json.dump(meta, fh)
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
        outputs = set(self.graph.outputs)
        head_engine = self._engine(paths["head"], f"{self.model}@{self.version}/head/{cut.key}") if cut.device else None
        ce = CutEngines(cut.key, head_engine,
                        self._engine(paths["tail"], f"{self.model}@{self.version}/tail/{cut.key}"),
                        tuple(meta["boundary"]), tuple(o for o in meta["head_outputs"] if o in outputs))
        self.cuts[cut.key] = ce
        return ce

    def settle_device(self, runs: int = REFERENCE_RUNS) -> None:
        """Takes every loaded engine's reference CPU time ([Note: time-scaled device]) afresh from
        `runs` runs on zeros, the engines taking turns, so that a busy spell of the host falls on all
        of them alike and a cut's head and tail keep their share of the whole model's time. The
        engines' run times (`stats()`) start afresh."""
        engines = [self.full]  # the empty cut's tail is this one ([Note: time-scaled device])
        engines += [e for ce in self.cuts.values() for e in (ce.head, ce.tail) if e is not None and e is not self.full]
        feeds = [_zeros(e) for e in engines]
        factor = self.device.factor
        self.device.set_factor(1.0)  # at this host's speed: the references are CPU times
        self.device.forget_references()
        try:
            for _ in range(runs):
                for engine, x in zip(engines, feeds):
                    engine.run(x)
        finally:
            self.device.set_factor(factor)
            for engine in engines:  # their times are this host's, not the device's (the hedge reads them)
                engine.forget_times()

    def close(self) -> None:
        for ce in self.cuts.values():
            if ce.head is not None:
                ce.head.close()
            if ce.tail is not self.full:
                ce.tail.close()
        self.full.close()
