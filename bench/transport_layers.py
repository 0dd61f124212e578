"""The direct channel of two revisions, paired: does a layer of the channel pay?

    python -m bench.transport_layers --old REV [--pairs 20] [--slice-s 0.5] [--models transformer,resnet50]

Writes bench/results/transport_layers.json. Per model, two worker processes (this
checkout's code and revision ``REV``'s, from a git worktree made for the run and removed
after it), each a ``workers.actors`` SegmentWorker host (2 intra-op threads, 2 engine
instances, as bench/workers.py runs ours) serving the model's tail on its direct channel,
and two callers, each a ``ChannelClient`` of the same revision in a process of its own.
No Ray: the channel and the worker's code alone, which is what differs between the two.
Ray's part (a plain call opens the channel; the pool routes) is the same on both sides.

Every point is measured in pairs: old and new each get one slice of it, back to back,
the side that goes first alternating from pair to pair, so that load from other
processes on this shared 2-core machine falls on both alike; slices are short (0.5 s,
c32's three times that) and pairs many, because that load comes in bursts of seconds.
Per point:

* ``c1``: one caller, its input copied into the channel with each request; the serving
  overhead, p50 of (latency minus the worker's engine run, which the answer reports);
* ``c1_shared``: the same with the input kept in memory shared with the worker
  (``ChannelClient.pin_array``, ``ReplicaPool.shared_array``);
* ``c1_bound``: only where the revision has it (``ChannelClient.bound_frame``): a
  request whose input and outputs are both kept there, sent by a frame made once;
* ``c32``: 32 callers, each sending its next request when its last returns: requests
  per second.

The pairs' spread is the interquartile range of the per-pair differences (new minus
old); a difference is "beyond the pairs' spread" when that range lies wholly on one side
of zero, i.e. when at least three quarters of the pairs agree on its sign.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREADS = 2
INSTANCES = 2
LOWER_IS_BETTER = {"c1": True, "c1_shared": True, "c1_bound": True, "c32": False}


# -- the processes of one side (run with that side's checkout first on sys.path) ----------


def _tail(model: str):
    from bench.workers import MODELS

    return MODELS[model]()


def _serve(model: str) -> None:
    """A worker: hosts the tail and opens its direct channel as the Ray actor would."""
    from types import SimpleNamespace

    import ray

    from cluster.server import new_event_loop
    from workers.actors import _TimingHost
    from workers.engine import EngineConfig

    # open_channel asks Ray for the node's address and id; no Ray runs here.
    ray.util.get_node_ip_address = lambda: "127.0.0.1"
    ray.get_runtime_context = lambda: SimpleNamespace(get_node_id=lambda: "local")
    config = EngineConfig(intra_op_threads=THREADS, cache_dir=tempfile.mkdtemp(prefix="bench-layers-"),
                          share_weights=False)
    host = _TimingHost({f"{model}@1@tail": _tail(model).SerializeToString()}, engine_config=config,
                       instances=INSTANCES)

    async def main() -> None:
        info = await host.open_channel()
        print(json.dumps({"path": info["path"], "token": info["token"].hex()}), flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)  # until the caller closes our stdin

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())


def _call(model: str) -> None:
    """A caller: starts its worker, then answers each command on stdin with a point."""
    from cluster.server import new_event_loop
    from workers._transport import ChannelClient
    from workers.engine import Engine, EngineConfig

    server = subprocess.Popen([sys.executable, "-c", _BOOT, os.environ["LAYERS_TREE"], "serve", model],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    engine = Engine(_tail(model), EngineConfig(intra_op_threads=1, cache_dir=tempfile.mkdtemp(prefix="bench-layers-")))
    [(name, x)] = engine.random_inputs(1).items()
    outputs = {k: (v.shape, v.dtype) for k, v in engine.run({name: x}, copy=True).items()}
    engine.close()
    key = f"{model}@1@tail"
    info = json.loads(server.stdout.readline())

    async def main() -> None:
        client = await ChannelClient.connect(info["path"], bytes.fromhex(info["token"]))
        shared = client.pin_array(x.shape, x.dtype)
        shared[...] = x
        bound = None
        if hasattr(client, "bound_frame"):
            outs = {k: client.pin_array(shape, dtype) for k, (shape, dtype) in outputs.items()}
            if all(o is not None for o in outs.values()):
                bound = outs

        async def one(feed: dict, **kwargs) -> tuple[float, float]:
            t = time.perf_counter()
            [result] = await client.call(key, [feed], [None], [0], **kwargs)
            latency = time.perf_counter() - t
            if isinstance(result, BaseException):
                raise result
            return latency, latency - result[1].compute_s

        frame = None

        async def c1(feed: dict, seconds: float, with_outputs: bool = False) -> float:
            nonlocal frame
            overheads = []
            stop = time.perf_counter() + seconds
            while time.perf_counter() < stop:
                if not with_outputs:
                    overheads.append((await one(feed))[1])
                    continue
                # As the revision's BoundRequest.run: the frame made after the first run, then sent as it stands.
                overheads.append((await one(feed, outputs=bound, bound=frame))[1])
                if frame is None:
                    frame = client.bound_frame(key, feed, bound)
            return statistics.median(overheads) * 1e3

        async def c32(seconds: float) -> float:
            done = [0]
            opens = time.perf_counter() + seconds / 5
            closes = opens + seconds

            async def loop() -> None:
                while time.perf_counter() < closes:
                    await one({name: x})
                    if opens <= time.perf_counter() <= closes:
                        done[0] += 1

            await asyncio.gather(*(loop() for _ in range(32)))
            return done[0] / seconds

        points = {"c1": lambda s: c1({name: x}, s), "c1_shared": lambda s: c1({name: shared}, s),
                  "c32": c32}
        if bound is not None:
            points["c1_bound"] = lambda s: c1({name: shared}, s, with_outputs=True)
        for point in points.values():  # warm every path
            await point(0.5)
        print(json.dumps(sorted(points)), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            point, seconds = json.loads(line)
            print(json.dumps(await points[point](seconds)), flush=True)
        client.close()

    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(main())
    finally:
        server.stdin.close()
        server.wait(30)


_BOOT = "import os, sys; os.environ['LAYERS_TREE'] = sys.argv[1]; sys.path.insert(0, sys.argv[1]); " \
        "os.chdir(sys.argv[1]); import runpy; " \
        f"m = runpy.run_path({os.path.abspath(__file__)!r}); m['_' + sys.argv[2]](sys.argv[3])"
"""Runs this file's ``_serve`` or ``_call`` with a side's checkout first on sys.path (this
file's own directory is not put there: its workers.py would shadow the package)."""


# -- the pairs ------------------------------------------------------------------------------


class _Side:
    def __init__(self, tree: str, model: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, tree, "call", model], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.points = json.loads(self.proc.stdout.readline())

    def measure(self, point: str, seconds: float) -> float:
        self.proc.stdin.write(json.dumps([point, seconds]) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def _verdict(old: list[float], new: list[float], lower_is_better: bool) -> dict:
    diffs = [n - o for o, n in zip(old, new)]
    q1, _, q3 = statistics.quantiles(diffs, n=4)
    beyond = q1 > 0 or q3 < 0
    better = (statistics.median(diffs) < 0) == lower_is_better
    return {
        "old_median": statistics.median(old), "new_median": statistics.median(new),
        "new_minus_old_median": statistics.median(diffs),
        "new_minus_old_interquartile": [q1, q3],
        "new_minus_old_per_pair": [round(d, 4) for d in diffs],
        "beyond_the_pairs_spread": beyond,
        "verdict": ("no difference beyond the pairs' spread" if not beyond
                    else "new better beyond the pairs' spread" if better
                    else "old better beyond the pairs' spread"),
    }


def bench_model(old_tree: str, model: str, pairs: int, slice_s: float) -> dict:
    sides = {"old": _Side(old_tree, model), "new": _Side(REPO, model)}
    try:
        got: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
        for p in range(pairs):
            print(f"{model}: pair {p + 1}/{pairs}", flush=True)
            order = ("old", "new") if p % 2 == 0 else ("new", "old")
            for point in ("c1", "c1_shared", "c1_bound", "c32"):
                seconds = slice_s * 3 if point == "c32" else slice_s
                for side in order:
                    if point in sides[side].points:
                        got[side].setdefault(point, []).append(sides[side].measure(point, seconds))
        out: dict = {"units": {"c1": "ms overhead p50", "c1_shared": "ms overhead p50",
                               "c1_bound": "ms overhead p50", "c32": "requests/s"}}
        for point in ("c1", "c1_shared", "c32"):
            out[point] = _verdict(got["old"][point], got["new"][point], LOWER_IS_BETTER[point])
        if "c1_bound" in got["old"]:
            # What a bound request's caller has once bound requests are gone: its input kept in shared memory.
            out["old_c1_bound_against_new_c1_shared"] = _verdict(got["old"]["c1_bound"], got["new"]["c1_shared"],
                                                                 True)
        out["per_pair"] = got
        return out
    finally:
        for side in sides.values():
            side.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the revision to compare this checkout with (e.g. HEAD~1)")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--slice-s", type=float, default=0.5)
    parser.add_argument("--models", default="transformer,resnet50")
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args()
    if args.pairs < 5:
        parser.error(f"--pairs {args.pairs}: a paired comparison here takes at least 5 pairs")
    old_rev = subprocess.run(["git", "-C", REPO, "rev-parse", args.old], check=True, capture_output=True,
                             text=True).stdout.strip()
    new_rev = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], check=True, capture_output=True,
                             text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", REPO, "status", "--porcelain", "workers"], check=True,
                                capture_output=True, text=True).stdout.strip())
    old_tree = os.path.join(tempfile.mkdtemp(prefix="bench-layers-"), "old")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", old_tree, old_rev], check=True,
                   capture_output=True)
    try:
        results = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "note": "2 cores shared with other people's tests and benchmarks while this ran; each point "
                                "alternates old and new slice by slice, the side that goes first alternating from "
                                "pair to pair, so that load falls on both sides alike and the per-pair differences, "
                                "not the medians of either side, carry the verdict"},
            "old": old_rev, "new": new_rev + (" with uncommitted changes to workers/" if dirty else ""),
            "settings": {"pairs": args.pairs, "slice_s": args.slice_s, "threads": THREADS, "instances": INSTANCES},
            "models": {m: bench_model(old_tree, m, args.pairs, args.slice_s) for m in args.models.split(",") if m},
        }
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", old_tree], capture_output=True)
        shutil.rmtree(os.path.dirname(old_tree), ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "transport_layers.json"), "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
    for model, entry in results["models"].items():
        for point, v in entry.items():
            if isinstance(v, dict) and "verdict" in v:
                print(f"{model} {point}: old {v['old_median']:.3f}, new {v['new_median']:.3f}, new - old per pair: "
                      f"median {v['new_minus_old_median']:.3f}, interquartile {v['new_minus_old_interquartile'][0]:.3f}"
                      f" to {v['new_minus_old_interquartile'][1]:.3f} ({v['verdict']})")


if __name__ == "__main__":
    main()
