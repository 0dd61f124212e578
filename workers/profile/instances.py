"""How many engine instances a segment should run on this host, found by timing.

[Note: choosing instances]
A worker can run a segment's batches on N engines of 1/N of its intra-op threads each,
side by side ([Note: engine instances] in workers/segment.py). Whether that pays depends
on the model and the machine: on 2 cores, two one-thread sessions ran the DenseNet121
tail's batch 8 at 1.3-1.5x the rate of one two-thread session, the transformer block's
at 1.0x. Triton leaves the count to its model analyzer, which measures each setting
offline; this is that measurement for one segment.

Timing it is the hard part on a shared machine. Chosen at load, from a fraction of a
second per side, the same DenseNet121 tail read anywhere from 0.6x to 1.3x. So here:

* every setting runs for whole seconds (``slice_s``), its engines each looping on a
  thread of their own at the batch the worker would form;
* the one-engine baseline is timed before and after every other setting's slice, and a
  slice counts as its ratio to the mean of the two baselines beside it (the machine's
  speed drifts by a third within a minute here, and bracketing cancels the drift);
* the verdict is the median over rounds: the best setting is chosen if its median
  beats one engine by ``margin``, else one engine stays (more engines hold more
  buffers).

The answer is a line for model.yaml (``instances: N``) or ``PoolConfig(instances=N)``.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from workers.engine import Engine, EngineConfig
from workers.errors import ActorConfigError
from workers.segment import _instance_threads

__all__ = ["InstanceChoice", "InstanceTiming", "choose_instances", "time_instances"]


@dataclass(frozen=True)
class InstanceTiming:
    """One setting's slices: ``instances`` engines of ``threads_each`` threads."""

    instances: int
    threads_each: int
    per_s: tuple[float, ...]
    """Rows per second in each round's slice."""
    ratios: tuple[float, ...]
    """Each slice over the mean of the one-engine slices just before and after it."""

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "median_ratio": self.median_ratio}


@dataclass(frozen=True)
class InstanceChoice:
    """What :func:`time_instances` measured and chose."""

    model: str
    provider: str
    """The execution provider the engines run on."""
    threads: int
    rows: int
    """Rows per run: the batch the worker forms, or 1 where the segment cannot batch."""
    baseline_per_s: tuple[float, ...]
    """One engine of ``threads`` threads: rows per second in every baseline slice, in
    order (one first, then one after every other setting's slice)."""
    timings: tuple[InstanceTiming, ...]
    margin: float
    instances: int
    """The choice: 1 unless a setting beat one engine by ``margin``."""
    reason: str

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["timings"] = [t.to_dict() for t in self.timings]
        return d


def choose_instances(timings: Sequence[InstanceTiming], *, margin: float) -> tuple[int, str]:
    """The count to run, and why: the setting with the best median ratio if that median
    beats one engine by ``margin``, else 1 (more engines cost memory: their buffers)."""
    if not timings:
        return 1, "no setting other than one engine was timed"
    best = max(timings, key=lambda t: t.median_ratio)
    wins = sum(r >= 1 + margin for r in best.ratios)
    what = (f"{best.instances} engines of {best.threads_each} thread(s) ran {best.median_ratio:.2f}x one engine "
            f"(median; rounds {min(best.ratios):.2f}-{max(best.ratios):.2f}, {wins} of {len(best.ratios)} "
            f"at {1 + margin:.2f}x or more)")
    if best.median_ratio >= 1 + margin:
        return best.instances, what
    return 1, f"the best setting, {what}, is not {margin:.0%} faster than one engine"


def _side_by_side(engines: Sequence[Engine], feeds: Sequence[dict], rows: int, slice_s: float) -> float:
    """Each engine looping on a thread of its own for ``slice_s``; rows per second."""
    counts = [0] * len(engines)
    errors: list[BaseException] = []

    def loop(i: int, stop: float) -> None:
        try:
            while time.perf_counter() < stop or counts[i] == 0:
                engines[i].run(feeds[i])
                counts[i] += 1
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            errors.append(e)

    start = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(i, start + slice_s)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return rows * sum(counts) / (time.perf_counter() - start)


def _rows_of(inputs: Mapping[str, np.ndarray], engine: Engine, rows: int) -> dict[str, np.ndarray]:
    """Sample inputs at ``rows`` rows: repeated along each input whose batch is dynamic."""
    out = {}
    for spec in engine.inputs:
        v = np.asarray(inputs[spec.name])
        if spec.shape and spec.shape[0] is None and v.ndim and v.shape[0] and v.shape[0] != rows:
            v = np.take(v, np.arange(rows) % v.shape[0], axis=0)
        out[spec.name] = v
    return out


def time_instances(
    model: onnx.ModelProto | bytes,
    *,
    name: str = "segment",
    threads: int,
    batch: int = 8,
    candidates: Sequence[int] = (2,),
    rounds: int = 5,
    slice_s: float = 1.0,
    margin: float = 0.05,
    engine_config: EngineConfig | None = None,
    progress: Callable[[str], None] | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
) -> InstanceChoice:
    """Times one engine of ``threads`` threads against each count in ``candidates``
    (engines of ``threads // count`` threads side by side, weights shared) at ``batch``
    rows a run, in bracketed rounds (see [Note: choosing instances]); returns what it
    measured and the count to run. ``progress`` is called with a line per slice.
    ``inputs`` are sample inputs by the segment's input names, their rows repeated to
    the batch along each input whose batch is dynamic; without them the runs are on
    random inputs (`Engine.random_inputs`)."""
    problems = [f"candidates={list(candidates)!r}: use counts of 1 or more"] if any(
        type(c) is not int or c < 1 for c in candidates) else []
    for label, value, ok in (("threads", threads, type(threads) is int and threads >= 1),
                             ("batch", batch, type(batch) is int and batch >= 1),
                             ("rounds", rounds, type(rounds) is int and rounds >= 1),
                             ("slice_s", slice_s, slice_s > 0), ("margin", margin, margin >= 0)):
        if not ok:
            problems.append(f"{label}={value!r}: use a positive value")
    if problems:
        raise ActorConfigError("cannot time engine instances: " + "; ".join(problems) + " (e.g. threads=2, "
                               "batch=8, candidates=(2,), rounds=5, slice_s=1.0, margin=0.05)",
                               field_name="instances", value=list(candidates), model=name)
    counts = sorted(set(candidates) - {1})
    config = dataclasses.replace(
        engine_config or EngineConfig(),
        intra_op_threads=threads, share_weights=True)
    say = progress or (lambda line: None)

    def each(count: int) -> int:
        """Intra-op threads of each of ``count`` engines, as the worker splits them."""
        return _instance_threads(config, count)

    def engines(count: int) -> list[Engine]:
        cfg = dataclasses.replace(config, intra_op_threads=each(count))
        return [Engine(model, cfg, name=f"{name}#{i}") for i in range(count)]

    say(f"loading {name}: one engine of {threads} thread(s), and "
        + (", ".join(f"{c} of {each(c)}" for c in counts) or "no other setting"))
    one: list[Engine] = []
    settings: dict[int, list[Engine]] = {}
    try:
        one = engines(1)
        provider = one[0].provider
        rows = min(batch, one[0].max_batch) if one[0].batch_safe else 1
        for c in counts:
            settings[c] = engines(c)
        feeds = {c: [_rows_of(inputs, e, rows) if inputs is not None else e.random_inputs(rows, seed=i)
                     for i, e in enumerate(es)] for c, es in [(1, one), *settings.items()]}
        for c, es in [(1, one), *settings.items()]:  # warm every engine and its threads
            _side_by_side(es, feeds[c], rows, min(slice_s, 0.2))
        before = _side_by_side(one, feeds[1], rows, slice_s)
        baseline = [before]
        per_s: dict[int, list[float]] = {c: [] for c in counts}
        ratios: dict[int, list[float]] = {c: [] for c in counts}
        for r in range(rounds):
            # Rotate the order so that no setting always follows the same one.
            order = counts[r % len(counts):] + counts[:r % len(counts)] if counts else []
            for c in order:
                tp = _side_by_side(settings[c], feeds[c], rows, slice_s)
                after = _side_by_side(one, feeds[1], rows, slice_s)
                baseline.append(after)
                per_s[c].append(tp)
                ratios[c].append(tp / ((before + after) / 2))
                before = after
                say(f"round {r + 1}/{rounds}: {c} engines {tp:.1f} rows/s, {ratios[c][-1]:.2f}x one engine")
    finally:
        for e in [*one, *(e for es in settings.values() for e in es)]:
            e.close()
    timings = tuple(InstanceTiming(c, each(c), tuple(per_s[c]), tuple(ratios[c])) for c in counts)
    chosen, reason = choose_instances(timings, margin=margin)
    return InstanceChoice(model=name, provider=provider, threads=threads, rows=rows, baseline_per_s=tuple(baseline), timings=timings,
                          margin=margin, instances=chosen, reason=reason)
