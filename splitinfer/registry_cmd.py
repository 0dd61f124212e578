"""`splitinfer registry ...`: write models into the registry layout the gateway serves.

    splitinfer registry add MODEL REGISTRY [--name N] [--version V] [--force] [--description TEXT]
                            [--profile [--runs N]] [--edge DEVICE] [--cloud DEVICE] [--frontier]
                            [--input-shape NAME=D0xD1x... ...] [--inputs FILE.npz]
    splitinfer registry list REGISTRY

`add` writes REGISTRY/<name>/<version>/{model.onnx, model.yaml} (docs/registry.md) and,
with the flags, the rest of what the gateway and the edge agents read:

- `--profile` measures profiles/device.json (one ONNX Runtime thread: the emulated edge,
  as in the demo) and profiles/cloud.json (every core: the gateway's workers) here;
- `--edge DEVICE` / `--cloud DEVICE` write a reference device's roofline estimate
  (rpi4, jetson-orin-nano, t4, ...) as that profile instead;
- `--frontier` writes frontier.json (the planner's frontier from both profiles, else the
  default chain cuts, as the gateway would choose) and cuts the tail of every preloaded
  cut into segments/, so the gateway starts without cutting;
- `--input-shape NAME=D0xD1x...` (repeatable; NAME may be left out for a one-input model)
  writes model.yaml's `input_shapes`, and `--inputs FILE.npz` copies the sample inputs
  beside the model as inputs.npz (model.yaml's `sample_inputs`): the gateway warms its
  tails up and checks batching on them.

MODEL is an .onnx path or a zoo short name (seeded random weights). The name defaults to
the file's stem or the zoo name; the version to one above the highest numeric version
(1 for a new model). Everything is written in a staging directory inside REGISTRY and
moved into place by one rename: a gateway never sees half a version, and a failure or
Ctrl-C leaves the registry as it was.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from splitinfer.units import int_at_least

__all__ = ["AddOptions", "RegistryCommandError", "add_model", "next_version", "registry_main"]

_STAGING_PREFIX = ".registry-add-"
"""Starts with '.', so the gateway's registry never takes a staging directory for a model."""


class RegistryCommandError(Exception):
    """A `splitinfer registry` request that cannot be done; the message names the value and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


@dataclass(frozen=True)
class AddOptions:
    """What `registry add` writes besides model.onnx and model.yaml."""

    name: str | None = None
    """Model name; None: the file's stem or the zoo name."""
    version: str | None = None
    """Version; None: one above the highest numeric version, or 1."""
    force: bool = False
    """Replace an existing version."""
    description: str | None = None
    """model.yaml's description; None: where the model came from."""
    profile: bool = False
    """Measure the device (one thread) and cloud (every core) profiles on this host."""
    runs: int = 8
    """Timed runs per profile."""
    edge: str | None = None
    """Reference device whose estimate is profiles/device.json."""
    cloud: str | None = None
    """Reference device whose estimate is profiles/cloud.json."""
    frontier: bool = False
    """Write frontier.json and cut the preloaded tails into segments/."""
    input_shapes: tuple[str, ...] = ()
    """``--input-shape`` values (``NAME=D0xD1x...``), written as model.yaml's input_shapes."""
    inputs: str | None = None
    """An .npz of sample inputs by input name, copied beside the model (model.yaml's sample_inputs)."""


def next_version(registry: str, name: str) -> str:
    """One above the highest all-digit version of `name` in `registry`; '1' when there is none."""
    d = os.path.join(registry, name)
    numbers = [int(v) for v in os.listdir(d) if v.isdigit()] if os.path.isdir(d) else []
    return str(max(numbers) + 1) if numbers else "1"


def _check_name(flag: str, value: str) -> None:
    from cluster.registry import NAME_PATTERN

    if not NAME_PATTERN.match(value):
        raise RegistryCommandError(
            f"{flag} {value!r} is not a valid registry name: use letters, digits, '.', '_' and '-', starting with "
            f"a letter or digit, at most 128 characters{'; name the model with --name' if flag == 'name' else ''}")


def _check_device(flag: str, value: str | None) -> None:
    if value is None:
        return
    from planner.devices import device_names

    if value not in device_names():
        raise RegistryCommandError(f"{flag} {value!r} is not a reference device; choose one of "
                                   f"{', '.join(device_names())}")


def _load(spec: str) -> tuple[Any, Any, str, str]:
    """(model, graph, name, description) of an .onnx path or a zoo name."""
    from partitioner import PartitionError, build_graph, load_model, load_zoo
    from splitinfer.partition_cmd import resolve_model

    path, name = resolve_model(spec)
    is_file = os.path.exists(spec) or spec.endswith(".onnx") or os.sep in spec
    model = load_model(path) if is_file else load_zoo(name, random_weights=True, seed=0)
    try:
        graph = build_graph(model, name=name)
    except PartitionError:
        raise
    except Exception as e:  # noqa: BLE001 - shape inference raises many types for a broken model
        raise RegistryCommandError(f"{spec}: is not a model the partitioner can read ({type(e).__name__}: "
                                   f"{str(e)[:200]}); export a valid ONNX model") from e
    where = (f"{os.path.basename(path)}" if is_file
             else f"{name} from the onnx package's model zoo with seeded random weights")
    return model, graph, name, where


_SAMPLES_FILE = "inputs.npz"
"""Where `--inputs` is copied in the version's directory."""


def _inputs_fields(model: Any, o: AddOptions) -> dict[str, Any]:
    """model.yaml's input_shapes and sample_inputs from the flags, checked against the model."""
    if not o.input_shapes and o.inputs is None:
        return {}
    from partitioner import PartitionError
    from partitioner.shapes import load_sample_inputs, parse_input_shapes, shapes_of

    weights = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in weights]
    out: dict[str, Any] = {}
    try:
        shapes = parse_input_shapes(o.input_shapes, names)
        if o.inputs is not None:
            given = shapes_of(load_sample_inputs(o.inputs, names))
            for name, shape in shapes.items():
                if given[name] != shape:
                    raise RegistryCommandError(
                        f"--input-shape gives {name!r} the shape {'x'.join(map(str, shape))}, but --inputs "
                        f"{o.inputs!r} has {'x'.join(map(str, given[name]))}; make them agree, or leave "
                        "--input-shape out (the samples fix the shapes)")
            out["sample_inputs"] = _SAMPLES_FILE
    except PartitionError as e:
        raise RegistryCommandError(str(e)) from e
    if shapes:
        out["input_shapes"] = {k: list(v) for k, v in shapes.items()}
    return out


def _write_yaml(path: str, name: str, version: str, description: str, extra: dict[str, Any] | None = None) -> None:
    import yaml

    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"# {name}@{version}, written by splitinfer registry add; every field: docs/registry.md\n")
        yaml.safe_dump({"name": name, "description": description, **(extra or {})}, fh, sort_keys=False,
                       default_flow_style=None)


def _profiles(model: Any, graph: Any, o: AddOptions, say: Callable[[str], None]) -> dict[str, tuple[Any, str]]:
    """profiles/ file name -> (Profile, what it is)."""
    out: dict[str, tuple[Any, str]] = {}
    if o.profile:
        from splitinfer.demo.setup import measure_profiles

        dev, cloud, source, dev_ms, cloud_ms = measure_profiles(model, graph, o.runs, say, lambda: None)
        out["device.json"] = (dev, f"{source} with 1 thread, {dev_ms:.0f} ms per run")
        out["cloud.json"] = (cloud, f"{source} with {os.cpu_count() or 1} threads, {cloud_ms:.0f} ms per run")
    for file, device in (("device.json", o.edge), ("cloud.json", o.cloud)):
        if device is not None:
            from planner.devices import reference_profile

            out[file] = (reference_profile(device, graph), f"{device} roofline estimate")
    return out


def add_model(spec: str, registry: str, o: AddOptions = AddOptions(), *,
              say: Callable[[str], None] = print) -> str:
    """Writes `spec` into `registry` as <name>/<version>/ (see the module docstring); returns that path.

    On any failure, or an interrupt, nothing it made is left: not the staging directory,
    nor a model directory or registry directory it created."""
    _check_device("--edge", o.edge)
    _check_device("--cloud", o.cloud)
    if o.name is not None:
        _check_name("--name", o.name)
    if o.version is not None:
        _check_name("--version", o.version)
    if os.path.exists(registry) and not os.path.isdir(registry):
        raise RegistryCommandError(f"REGISTRY {registry!r} is a file; give a directory (it is created if missing)")
    steps = 2 + (o.profile or o.edge is not None or o.cloud is not None) + o.frontier
    step = iter(range(1, steps + 1))
    t0 = time.monotonic()
    say(f"[{next(step)}/{steps}] loading {spec}")
    model, graph, default_name, where = _load(spec)
    inputs_fields = _inputs_fields(model, o)
    name = o.name or default_name
    _check_name("--name" if o.name else "name", name)
    version = o.version or next_version(registry, name)
    final = os.path.join(registry, name, version)
    if os.path.exists(final) and not o.force:
        raise RegistryCommandError(f"{final} already exists; give --version {next_version(registry, name)} for a "
                                   "new version, or --force to replace it")
    say(f"      {len(graph)} layers, {graph.total_flops / 1e9:.2f} GFLOPs, "
        f"{graph.total_param_bytes / 2**20:.1f} MiB of weights")
    made = [d for d in (registry, os.path.join(registry, name)) if not os.path.isdir(d)]
    try:
        os.makedirs(registry, exist_ok=True)
        stage = tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=registry)
    except OSError as e:
        raise RegistryCommandError(f"cannot write to REGISTRY {registry!r} ({e.strerror}); give a directory you "
                                   "can write to") from e
    done = False
    try:
        vdir = os.path.join(stage, name, version)
        os.makedirs(vdir)
        say(f"[{next(step)}/{steps}] writing {name}/{version}/model.onnx and model.yaml")
        import onnx

        try:
            onnx.save_model(model, os.path.join(vdir, "model.onnx"))
        except ValueError as e:  # a model of 2 GiB or more does not fit one protobuf
            raise RegistryCommandError(f"{spec}: cannot be written as one model.onnx ({e}); the registry holds "
                                       "single-file models under 2 GiB") from e
        _write_yaml(os.path.join(vdir, "model.yaml"), name, version, o.description or where, inputs_fields)
        written = ["model.onnx", "model.yaml"]
        if o.inputs is not None:
            shutil.copyfile(o.inputs, os.path.join(vdir, _SAMPLES_FILE))
            written.append(_SAMPLES_FILE)
        if o.profile or o.edge is not None or o.cloud is not None:
            say(f"[{next(step)}/{steps}] profiles")
            profiles = _profiles(model, graph, o, say)
            os.makedirs(os.path.join(vdir, "profiles"))
            for file, (prof, what) in profiles.items():
                with open(os.path.join(vdir, "profiles", file), "w", encoding="utf-8") as fh:
                    fh.write(prof.to_json())
                say(f"      profiles/{file}: {prof.device} ({what})")
                written.append(f"profiles/{file}")
        if o.frontier:
            written += _frontier(stage, name, version, say, f"[{next(step)}/{steps}]")
        _move_into_place(stage, vdir, final, o.force)
        done = True
    except OSError as e:
        raise RegistryCommandError(f"cannot write {e.filename or registry} ({e.strerror}); check the free space and "
                                   "the permissions of REGISTRY") from e
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if not done:
            for d in reversed(made):
                try:
                    os.rmdir(d)  # only when empty: someone else may have written there meanwhile
                except OSError:
                    pass
    say(f"added {name}@{version} to {registry} in {time.monotonic() - t0:.1f} s: {', '.join(written)}")
    return final


def _frontier(stage: str, name: str, version: str, say: Callable[[str], None], label: str) -> list[str]:
    from cluster.registry import VersionFiles

    files = VersionFiles(stage, name, version)
    files.check_inputs()
    say(f"{label} frontier.json and the tails of its cuts")
    front = files.frontier()
    say(f"      {len(front.cuts)} cuts to preload ({front.source} frontier)")
    if front.source == "default":
        say("      (the default chain cuts: the planner's frontier needs both profiles; give --profile, or --edge "
            "and --cloud)")
    if not front.cuts:
        say("      every plan keeps the whole model on the device: the device profile is not slower than the "
            "cloud's; give --edge DEVICE (such as rpi4) for a slower device")
    for i, cut in enumerate(front.cut_ids, 1):
        say(f"      tail {i}/{len(front.cuts)}: segments/{cut}/tail.onnx")
        files.tail_path(cut, known=front.cut_ids)
    return ["frontier.json", f"segments/ ({len(front.cuts)} tails)"]


def _move_into_place(stage: str, vdir: str, final: str, force: bool) -> None:
    os.makedirs(os.path.dirname(final), exist_ok=True)
    old = None
    if os.path.exists(final):
        if not force:
            raise RegistryCommandError(f"{final} appeared while this ran; run again with --force to replace it")
        old = os.path.join(stage, "replaced")
        os.rename(final, old)
    try:
        os.rename(vdir, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)
        raise


# -- list -------------------------------------------------------------------------------


def _describe_version(vdir: str) -> str:
    parts = [f"model.onnx {os.path.getsize(os.path.join(vdir, 'model.onnx')) / 1e6:.1f} MB"]
    prof = os.path.join(vdir, "profiles")
    if os.path.isdir(prof):
        names = sorted(f[:-5] for f in os.listdir(prof) if f.endswith(".json"))
        if names:
            parts.append("profiles " + "+".join(names))
    if os.path.exists(os.path.join(vdir, "frontier.json")):
        parts.append("frontier")
    seg = os.path.join(vdir, "segments")
    if os.path.isdir(seg):
        parts.append(f"{len(os.listdir(seg))} tails")
    return ", ".join(parts)


def list_registry(registry: str, out: Callable[[str], None] = print) -> int:
    """Prints every model and version, and what does not fit the layout; 0 when a model is there."""
    from cluster.registry import LAYOUT, survey

    s = survey(registry)
    if not s.models:
        out(f"{registry}: {s.found()}; expected {LAYOUT}; add a model with: splitinfer registry add MODEL {registry}")
        return 0
    out(f"{registry}: {len(s.models)} model(s)")
    for model, versions in s.models.items():
        for v in versions:
            out(f"  {model}@{v}  {_describe_version(os.path.join(registry, model, v))}")
    for p in s.problems:
        out(f"  not served: {p}")
    return 0


# -- command line -------------------------------------------------------------------------




def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitinfer registry", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{add,list}")
    a = sub.add_parser("add", help="write a model into REGISTRY/<name>/<version>/",
                       description="Write MODEL into REGISTRY/<name>/<version>/{model.onnx, model.yaml} and, "
                                   "with the flags, profiles/, frontier.json and segments/.")
    a.add_argument("model", metavar="MODEL", help="path to an .onnx file, or a zoo name such as squeezenet")
    a.add_argument("registry", metavar="REGISTRY", help="the registry directory (created if missing)")
    a.add_argument("--name", help="model name (default: the file's stem or the zoo name)")
    a.add_argument("--version", help="version (default: one above the highest numeric version, or 1)")
    a.add_argument("--force", action="store_true", help="replace the version if it exists")
    a.add_argument("--description", help="model.yaml's description (default: where the model came from)")
    a.add_argument("--profile", action="store_true",
                   help="measure profiles/device.json (1 thread: the emulated edge) and cloud.json (every core)")
    a.add_argument("--runs", type=int_at_least(1), default=AddOptions.runs, help="timed runs per profile (default 8)")
    a.add_argument("--edge", metavar="DEVICE", help="write DEVICE's roofline estimate as profiles/device.json "
                                                   "(rpi4, rpi5, jetson-orin-nano, phone-sd8g2, ...)")
    a.add_argument("--cloud", metavar="DEVICE", help="write DEVICE's roofline estimate as profiles/cloud.json "
                                                    "(t4, a100, h100, ...)")
    a.add_argument("--frontier", action="store_true",
                   help="write frontier.json and cut the preloaded tails into segments/ (the planner's frontier "
                        "with both profiles, else the default chain cuts)")
    a.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0xD1x...",
                   help="fix an input's symbolic dims, written as model.yaml's input_shapes (repeatable; NAME may "
                        "be left out for a model with one input)")
    a.add_argument("--inputs", metavar="FILE.npz",
                   help="sample inputs by input name (numpy.savez), copied beside the model: the gateway warms "
                        "its tails up and checks batching on them")
    ls = sub.add_parser("list", help="show the models and versions in REGISTRY, and what does not fit the layout")
    ls.add_argument("registry", metavar="REGISTRY")
    return p


def registry_main(argv: Sequence[str]) -> int:
    """Entry point of `splitinfer registry`; returns the exit code."""
    a = make_parser().parse_args(list(argv))
    if a.command == "list":
        return list_registry(a.registry)
    o = AddOptions(name=a.name, version=a.version, force=a.force, description=a.description, profile=a.profile,
                   runs=a.runs, edge=a.edge, cloud=a.cloud, frontier=a.frontier,
                   input_shapes=tuple(a.input_shape), inputs=a.inputs)
    add_model(a.model, a.registry, o, say=lambda line: print(line, flush=True))
    print(f"serve it: splitinfer gateway --registry {a.registry}")
    return 0
