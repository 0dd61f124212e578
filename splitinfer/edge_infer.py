"""`splitinfer edge infer`: one input to a running agent, and where its answer was computed.

The input comes from a .npy file (the model's one input), a .npz file (inputs by name),
or `--random` (seeded, shaped and typed as the agent's GET /v1/model says). The answer's
summary names each output with its dtype and shape (and the top classes of a class
vector) and says where it ran, from the answer's `served_by` and `cut_id`:

    served_by remote, cut with device layers   split: head on the device, tail in the cloud
    served_by remote, empty cut                remote: the whole model in the cloud
    served_by local_tail                       head on the device, tail finished here (the cloud failed)
    served_by local                            local: the whole model on the device
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["describe_placement", "infer_main", "make_random_inputs", "read_inputs", "summarize_answer"]


class _InputError(ValueError):
    pass


def _shape(dims: list[Any]) -> tuple[int, ...]:
    """Symbolic or unknown dimensions (names, None, -1) become 1: one sample."""
    return tuple(d if isinstance(d, int) and d > 0 else 1 for d in dims)


def make_random_inputs(model: Mapping[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs for every input GET /v1/model lists: normal floats, small integers, False."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in model.get("inputs", []):
        dtype, shape = np.dtype(spec.get("dtype", "float32")), _shape(list(spec.get("shape", [])))
        if dtype.kind == "f":
            out[spec["name"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            out[spec["name"]] = rng.integers(0, 10, shape).astype(dtype)
        else:
            out[spec["name"]] = np.zeros(shape, dtype)
    return out


def read_inputs(path: str, model: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Inputs from a .npy (the model's only input) or .npz (by name) file, cast to the model's
    dtypes where the kind matches (float64 to float32, say)."""
    specs = {s["name"]: s for s in model.get("inputs", [])}
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise _InputError(f"--input {path!r} cannot be read as .npy or .npz ({e})") from e
    if isinstance(loaded, np.ndarray):
        if len(specs) != 1:
            raise _InputError(f"--input {path!r} is one array but the model has inputs {sorted(specs)}; "
                              "give a .npz with one array per input name")
        arrays = {next(iter(specs)): loaded}
    else:
        with loaded:
            arrays = {k: loaded[k] for k in loaded.files}
        if set(arrays) != set(specs):
            raise _InputError(f"--input {path!r} holds {sorted(arrays)}; the model's inputs are {sorted(specs)}")
    out = {}
    for name, a in arrays.items():
        want = np.dtype(specs[name].get("dtype", a.dtype))
        out[name] = a.astype(want) if a.dtype != want and a.dtype.kind == want.kind else a
    return out


def describe_placement(served_by: str, cut_id: str) -> str:
    """Where an answer was computed, in words: see the module docstring."""
    from partitioner import Cut

    cut = Cut.from_key(cut_id) if cut_id else None
    layers = ""
    if cut is not None and cut.device:
        ids = sorted(cut.device)
        contiguous = ids == list(range(ids[0], ids[-1] + 1))
        layers = (f"layers {ids[0]}-{ids[-1]}" if contiguous else f"{len(ids)} layers") + ", "
    if served_by == "remote":
        if cut is not None and not cut.device:
            return f"remote: the whole model in the cloud (cut {cut_id})"
        return f"split: head on the device ({layers}cut {cut_id}), tail in the cloud"
    if served_by == "local_tail":
        return f"head on the device ({layers}cut {cut_id}), tail finished on the device (the cloud did not answer in time)"
    return "local: the whole model on the device"


def _top(a: np.ndarray, k: int) -> list[tuple[int, float]] | None:
    """The top-k (index, value) of a class vector: one axis of size >= 2, the others 1."""
    sizes = [d for d in a.shape if d != 1]
    if len(sizes) != 1 or sizes[0] < 2 or a.dtype.kind != "f":
        return None
    v = a.reshape(-1)
    idx = np.argsort(-v, kind="stable")[:k]
    return [(int(i), float(v[i])) for i in idx]


def summarize_answer(answer: Mapping[str, Any], k: int = 5) -> dict[str, Any]:
    """The printable summary of `EdgeClient.infer_full`'s answer."""
    outputs = []
    for name, a in answer["outputs"].items():
        a = np.asarray(a)
        row: dict[str, Any] = {"name": name, "dtype": str(a.dtype), "shape": list(a.shape)}
        top = _top(a, k)
        if top is not None:
            row["top"] = top
        outputs.append(row)
    served_by, cut_id = answer.get("served_by", ""), answer.get("cut_id") or ""
    return {"id": answer.get("id"), "served_by": served_by, "cut_id": cut_id,
            "encoding": answer.get("encoding"), "latency_ms": answer.get("latency_ms"),
            "where": describe_placement(served_by, cut_id), "fallback_reason": answer.get("fallback_reason") or "",
            "outputs": outputs}


def format_summary(s: Mapping[str, Any]) -> str:
    lines = [f"served by: {s['where']}"]
    enc = f", boundary {s['encoding']}" if s.get("encoding") and s["served_by"] != "local" else ""
    lines.append(f"latency: {s['latency_ms']:.1f} ms{enc}" if isinstance(s.get("latency_ms"), (int, float))
                 else "latency: unknown")
    if s.get("fallback_reason"):
        lines.append(f"fallback: {s['fallback_reason']}")
    for o in s["outputs"]:
        line = f"output {o['name']}: {o['dtype']} {o['shape']}"
        if "top" in o:
            line += "  top-%d: " % len(o["top"]) + ", ".join(f"{i} ({v:.4g})" for i, v in o["top"])
        lines.append(line)
    return "\n".join(lines)


def _wait_ready(client: Any, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if client.ready():
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return
        time.sleep(0.25)


def infer_main(args: argparse.Namespace) -> int:
    from edge_agent.client import EdgeClient

    where = args.socket or args.url
    if args.top < 1:
        print(f"splitinfer edge infer: error: --top is {args.top}; give 1 or more", file=sys.stderr)
        return 2
    try:
        with EdgeClient(args.url, unix_socket=args.socket, timeout_s=60.0) as c:
            if args.wait > 0:
                _wait_ready(c, args.wait)
            model = c.model()
            if "inputs" not in model:
                print(f"splitinfer edge infer: error: the agent at {where} is not ready: {model.get('message', model)}",
                      file=sys.stderr)
                return 1
            try:
                inputs = read_inputs(args.input, model) if args.input else make_random_inputs(model, args.seed)
            except _InputError as e:
                print(f"splitinfer edge infer: error: {e}", file=sys.stderr)
                return 2
            answer = c.infer_full(inputs)
    except OSError as e:
        print(f"splitinfer edge infer: error: cannot reach the agent at {where} ({e.strerror or e}); start it with "
              "'splitinfer edge run', or pass --url / --socket", file=sys.stderr)
        return 1
    s = summarize_answer(answer, args.top)
    print(json.dumps(s) if args.json else f"{model.get('model')}@{model.get('version')}\n{format_summary(s)}")
    return 0

