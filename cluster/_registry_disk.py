"""The on-disk side of the model registry: layout, model.yaml, frontier.json, tail segments.

One version lives in ``<root>/<name>/<version>/``::

    model.onnx          the whole model (required)
    model.yaml          serving settings (optional; every field has a default)
    profiles/*.json     planner Profiles (optional); with a device and a cloud profile the
                        frontier is computed by the planner
    frontier.json       the cuts worth preloading (written on first load, then reused)
    accuracy.json       agreement of every encoding per cut (`splitinfer calibrate`; optional)
    segments/<cut_id>/tail.onnx, cut.json   tails cut on demand, cached

A registry on a read-only volume still works: whatever cannot be written there goes
to a cache directory instead (see `VersionFiles.writable_dir`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from cluster._registry_frontier import FRONTIER_SCHEMA, CutEntry, VersionFrontier, compute_frontier
from cluster._registry_inputs import make_shaped_inputs, parse_input_shapes, read_sample_inputs
from cluster.errors import ClusterError

__all__ = [
    "RegistryError",
    "FrontierConfig",
    "ModelConfig",
    "CutEntry",
    "VersionFrontier",
    "VersionFiles",
    "FRONTIER_SCHEMA",
    "NAME_PATTERN",
    "version_sort_key",
    "compute_frontier",
    "set_model_yaml",
]

logger = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RegistryError(ClusterError):
    """A model directory, model.yaml or registry operation that is not valid."""

    def __init__(self, *, path: str, reason: str, fix: str) -> None:
        self.path = path
        self.reason = reason
        self.fix = fix
        super().__init__(f"{path}: {reason}; {fix}")


_VERSION_PARTS = re.compile(r"[.\-_]")
_VERSION_RUNS = re.compile(r"[0-9]+|[^0-9]+")


def version_sort_key(version: str) -> tuple[tuple[tuple[tuple[int, int, str], ...], ...], str]:
    """The project's one version order (the registry's; the planner asks the registry for it).

    Natural order: a version splits at '.', '-' and '_', and each part compares as runs of
    digits (by value) and of text, a number before text. So '2' < '10', 'v2' < 'v10',
    '1.2' < '1.10' and '9' < 'v1', as a person numbering versions means them. The string
    itself breaks the ties that values leave ('01' < '1').
    """
    parts = tuple(
        tuple((0, int(run), "") if run[0].isdigit() else (1, 0, run) for run in _VERSION_RUNS.findall(part))
        for part in _VERSION_PARTS.split(version)
    )
    return parts, version


def _check_keys(d: Any, allowed: Sequence[str], where: str, path: str) -> dict[str, Any]:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise RegistryError(path=path, reason=f"{where} must be a mapping, got {type(d).__name__}",
                            fix="write it as 'key: value' lines")
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise RegistryError(path=path, reason=f"{where} has unknown field(s) {unknown}",
                            fix=f"use only {', '.join(allowed)}")
    return d


def _typed(cls: type, d: Mapping[str, Any], path: str, where: str) -> Any:
    """Builds a frozen config, turning a wrong type into a RegistryError that names the field."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        value = d[f.name]
        default = getattr(cls, f.name, None) if f.default is not dataclasses.MISSING else None
        want = type(default) if default is not None else None
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if want is not None and (not isinstance(value, want) or (isinstance(value, bool) and want is not bool)):
            kind = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}.get(
                want.__name__, want.__name__)
            raise RegistryError(path=path, reason=f"{where}.{f.name} must be {kind}, got {value!r}",
                                fix=f"set {f.name} to {kind} such as {default!r}")
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise RegistryError(path=path, reason=f"{where}: {e}", fix="fix the value named above") from e


@dataclass(frozen=True)
class FrontierConfig:
    """How the cuts worth preloading are chosen for a version."""

    up_lo_bps: float = 1e6
    """Lowest uplink rate the frontier covers (planner frontier only)."""
    up_hi_bps: float = 1e9
    """Highest uplink rate the frontier covers."""
    down_ratio: float = 2.0
    """Downlink rate / uplink rate."""
    rtt_ms: float = 20.0
    """Round-trip time of the links covered."""
    objective: str = "latency"
    """'latency' or 'energy' (the frontier covers those two)."""
    device_profile: str = "device.json"
    """File under profiles/ with the device's Profile JSON."""
    cloud_profile: str = "cloud.json"
    """File under profiles/ with the cloud's Profile JSON."""
    default_cut_count: int = 3
    """Without both profiles: how many chain points (evenly spaced) to preload."""
    include_cloud_only: bool = True
    """Without both profiles: also preload the empty cut (the device sends the model input)."""

    def __post_init__(self) -> None:
        if not 0 < self.up_lo_bps <= self.up_hi_bps:
            raise ValueError(f"need 0 < up_lo_bps ({self.up_lo_bps}) <= up_hi_bps ({self.up_hi_bps})")
        if self.objective not in ("latency", "energy"):
            raise ValueError(f"objective {self.objective!r} must be 'latency' or 'energy'")
        if self.default_cut_count < 0:
            raise ValueError(f"default_cut_count {self.default_cut_count} must be >= 0")


_RAY_OWN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray sets from its own options, never from ``ray_resources``: the same
names workers._pool refuses in PoolConfig.resources, repeated here so that loading
a registry does not import the workers (and ONNX Runtime) to check a model.yaml."""


@dataclass(frozen=True)
class ModelConfig:
    """model.yaml: how one model version is served. Every field has a default."""

    name: str = ""
    """The model's name; when set it must equal the directory name."""
    description: str = ""
    """Free text for operators."""
    max_batch_size: int = 8
    """Most requests the dynamic batcher puts in one batch."""
    max_queue_delay_ms: float = 0.0
    """Longest the oldest request waits for company before its batch runs. 0: a lone
    request runs at once, and requests arriving while a batch runs form the next one,
    so batches still form under load without adding latency at concurrency 1."""
    max_queue_size: int = 256
    """Requests waiting per tail before new ones get RESOURCE_EXHAUSTED."""
    replicas: int = 1
    """Workers per tail: Ray actors, or with the in-process pool (``local-noray``) engines
    of the tail in the gateway process, each running its own batch (the weights are
    shared). With 2 or more in-process, give each fewer ``intra_op_threads``."""
    intra_op_threads: int = 0
    """ONNX Runtime threads per operator; 0 lets ORT choose."""
    instances: int = 1
    """Engines of the tail in each Ray worker, running its batches side by side, each
    on its share of ``intra_op_threads``; a lone request runs on an engine with all of
    them (docs/workers.md, engine instances). The in-process pool's engines are its
    ``replicas``."""
    max_request_bytes: int = 64 << 20
    """Largest boundary (sum of tensor bytes) one request may send."""
    ray_resources: Mapping[str, float] = field(default_factory=dict, hash=False)
    """Ray custom resources each of the tail's Ray workers asks for, such as
    ``{splitinfer-gpu-tier: 1}``: the workers go only to Ray nodes that declare them
    (the Helm chart's worker groups, ``rayCluster.*Workers.rayResources``), and with
    KubeRay's autoscaler, a group that declares them is scaled up for them. Empty: any
    node. The in-process pool (``local-noray``) has no nodes and ignores it."""
    frontier: FrontierConfig = field(default_factory=FrontierConfig)
    """How the preloaded cuts are chosen."""
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict, hash=False)
    """Shapes of the model's inputs with symbolic dims, by input name: ``[1, 3, 640, 640]``
    or ``"1x3x640x640"`` (``--input-shape`` of the other commands). They fix the shapes
    the model is cut and warmed up at; requests may still bring other sizes in the dims
    the model leaves symbolic."""
    sample_inputs: str = ""
    """An ``.npz`` of real inputs by input name (``numpy.savez``), relative to the
    version's directory (``--inputs`` of the other commands). Tails are warmed up on
    what the head makes of them, and the batch check runs on them, never on invented
    values. Empty: none."""

    min_agreement: float | None = None
    """The accuracy budget of this version's plans, a fraction in (0, 1]: its frontier (the
    tails preloaded, the plans agents get) holds only plans whose agreement with the fp32
    model, as accuracy.json measured it, is at least this; fp16, int8 and the lossy codecs
    are then placed where they meet it (planner [Note: accuracy budget]). None: lossless
    fp32 plans only."""

    cuda_graphs: bool | None = None
    """With the ``torch-cuda`` provider, run each batch bucket as a captured CUDA graph
    (``EngineConfig.cuda_graphs``; docs/engine.md). None: where the tail's sizes besides
    the batch are fixed. Other providers ignore it."""

    _FIELDS = ("name", "description", "max_batch_size", "max_queue_delay_ms", "max_queue_size", "replicas",
               "intra_op_threads", "instances", "max_request_bytes", "ray_resources", "frontier", "input_shapes",
               "sample_inputs", "min_agreement", "cuda_graphs")

    def __post_init__(self) -> None:
        for name, lo in (("max_batch_size", 1), ("max_queue_size", 1), ("replicas", 1), ("intra_op_threads", 0),
                         ("instances", 1), ("max_request_bytes", 1)):
            if getattr(self, name) < lo:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {lo}")
        if not self.max_queue_delay_ms >= 0:
            raise ValueError(f"max_queue_delay_ms={self.max_queue_delay_ms} must be >= 0")
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs={self.cuda_graphs!r} must be true or false")
        m = self.min_agreement
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m <= 1):
            raise ValueError(f"min_agreement={m!r} must be a fraction in (0, 1], such as 0.99, or left out for "
                             "lossless plans only")
        if not isinstance(self.ray_resources, Mapping):
            raise ValueError(f"ray_resources={self.ray_resources!r} must be a mapping of Ray resource name to "
                             "amount, such as {splitinfer-gpu-tier: 1}")
        for name, amount in self.ray_resources.items():
            if not (isinstance(name, str) and name and name not in _RAY_OWN_RESOURCES):
                raise ValueError(f"ray_resources names {name!r}; name a custom resource (CPU and GPU come from "
                                 "intra_op_threads and the provider), such as splitinfer-gpu-tier")
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
                raise ValueError(f"ray_resources[{name!r}]={amount!r} must be a number > 0, such as 1")
        # A copy of its own: the caller's dict changing later cannot change a frozen
        # config. Left out of the hash (a dict has none), so configs stay hashable.
        object.__setattr__(self, "ray_resources", dict(self.ray_resources))
        object.__setattr__(self, "input_shapes", parse_input_shapes(self.input_shapes))
        if self.sample_inputs:
            rel = self.sample_inputs
            if os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] == ".." or not rel.endswith(".npz"):
                raise ValueError(f"sample_inputs={rel!r} must be an .npz file inside the version's directory, "
                                 "given relative to it, such as inputs.npz")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def input_shape_specs(self) -> list[str]:
        """``input_shapes`` as ``--input-shape`` values (``NAME=D0xD1x...``)."""
        return [f"{k}={'x'.join(map(str, v))}" for k, v in self.input_shapes.items()]

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        d["frontier"] = FrontierConfig(**d.get("frontier", {}))
        return cls(**d)

    @classmethod
    def from_yaml_file(cls, path: str) -> ModelConfig:
        if not os.path.exists(path):
            return cls()
        try:
            with open(path, encoding="utf-8") as fh:
                raw = yaml.safe_load(fh)
        except yaml.YAMLError as e:
            raise RegistryError(path=path, reason=f"is not valid YAML ({e})", fix="fix the syntax") from e
        d = dict(_check_keys(raw, cls._FIELDS, "model.yaml", path))
        fr = _check_keys(d.pop("frontier", None), [f.name for f in dataclasses.fields(FrontierConfig)],
                         "model.yaml frontier", path)
        frontier = _typed(FrontierConfig, fr, path, "frontier")
        base = _typed(cls, d, path, "model.yaml")
        return dataclasses.replace(base, frontier=frontier)


def set_model_yaml(path: str, **fields: int | float | str) -> ModelConfig:
    """Sets top-level scalar fields of the model.yaml at ``path`` (created if missing)
    and returns the config it now holds. Each field's line is replaced where it stands,
    or added at the end; every other line, comments included, stays as it was. The new
    text must load as a ModelConfig (RegistryError naming the field, and the file
    untouched, otherwise); it replaces the file atomically."""
    # frontier's and input_shapes' fields span lines of their own
    settable = [f for f in ModelConfig._FIELDS if f not in ("frontier", "input_shapes")]
    unknown = sorted(set(fields) - set(settable))
    if unknown:
        raise RegistryError(path=path, reason=f"cannot set {unknown} this way",
                            fix=f"set top-level scalars only: {', '.join(settable)}")
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError:
        lines = []
    for name, value in fields.items():
        line = f"{name}: {json.dumps(value)}"
        at = [i for i, text in enumerate(lines) if re.match(rf"{re.escape(name)}\s*:", text)]
        if len(at) > 1:
            raise RegistryError(path=path, reason=f"sets {name} on {len(at)} lines", fix="keep one and try again")
        if at:
            lines[at[0]] = line
        else:
            lines.append(line)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".model.yaml.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        try:
            config = ModelConfig.from_yaml_file(tmp)
        except RegistryError as e:
            raise RegistryError(path=path, reason=f"would not load with {fields} set: {e.reason}", fix=e.fix) from None
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return config


class VersionFiles:
    """The files of one model version, and its tail segments cut and cached on demand."""

    def __init__(self, root: str, model: str, version: str, *, cache_dir: str | None = None) -> None:
        self.model = model
        self.version = version
        self.path = os.path.join(root, model, version)
        self.model_path = os.path.join(self.path, "model.onnx")
        self._cache_dir = cache_dir
        self._lock = threading.Lock()
        self._splitter: Any = None
        self._cut_index: dict[str, Any] | None = None
        self._check_dir()
        self.config = ModelConfig.from_yaml_file(os.path.join(self.path, "model.yaml"))
        if self.config.name and self.config.name != model:
            raise RegistryError(path=os.path.join(self.path, "model.yaml"),
                                reason=f"name {self.config.name!r} does not match the directory {model!r}",
                                fix=f"rename the directory or set name: {model}")

    def _check_dir(self) -> None:
        if not NAME_PATTERN.match(self.model) or not NAME_PATTERN.match(self.version):
            raise RegistryError(path=self.path, reason="model and version names must match "
                                f"{NAME_PATTERN.pattern}", fix="rename the directory")
        if not os.path.isdir(self.path):
            raise RegistryError(path=self.path, reason="is not a directory",
                                fix="create <registry>/<model>/<version>/ holding model.onnx")
        if not os.path.isfile(self.model_path):
            raise RegistryError(path=self.path, reason="has no model.onnx",
                                fix="copy the model there as model.onnx")
        if os.path.getsize(self.model_path) == 0:
            raise RegistryError(path=self.model_path, reason="is empty", fix="copy the whole model file again")

    # -- inputs: declared shapes and sample inputs -------------------------------------

    def _graph(self) -> Any:
        """The model's graph, read without its weights."""
        import onnx

        try:
            return onnx.load(self.model_path, load_external_data=False).graph
        except Exception as e:  # noqa: BLE001 - onnx raises DecodeError and others for a corrupt file
            raise RegistryError(path=self.model_path, reason=f"cannot be parsed as ONNX ({type(e).__name__})",
                                fix="export a valid ONNX model") from e

    def input_names(self) -> list[str]:
        """The model's inputs (graph inputs that are not initializers)."""
        graph = self._graph()
        weights = {t.name for t in graph.initializer}
        return [i.name for i in graph.input if i.name not in weights]

    def check_inputs(self) -> None:
        """Checks model.yaml's input_shapes and sample_inputs against the model; RegistryError
        naming the field, the value and the fix otherwise."""
        if self.config.input_shapes or self.config.sample_inputs:
            self.sample_inputs()

    def sample_inputs(self) -> dict[str, Any] | None:
        """model.yaml's sample_inputs, read and checked against the model; None without them."""
        return read_sample_inputs(self.path, self.config, self.input_names())

    def shaped_inputs(self) -> dict[str, Any] | None:
        """Random inputs at model.yaml's input_shapes where they are valid ones, for a
        version without sample inputs; None otherwise (see `make_shaped_inputs`)."""
        if not self.config.input_shapes or self.config.sample_inputs:
            return None
        return make_shaped_inputs(self._graph(), self.config.input_shapes)

    def tail_samples(self, cut_id: str, known: Sequence[str] = ()) -> dict[str, Any] | None:
        """The inputs of the tail of ``cut_id`` made from the version's sample inputs (or its
        input_shapes): the head run on them ([Note: warm-up inputs]). None without either.

        [Note: warm-up inputs]
        A tail's inputs are what the head makes of real model inputs, so the registry runs
        the head of the cut on ``sample_inputs`` (ONNX Runtime, once per tail when its
        pool starts) and hands the result to the tail's engines: their warm-up and batch
        check then run on real values. Without samples, declared ``input_shapes`` stand in
        where random values at those shapes are valid: every input with a symbolic dim
        besides the batch has a declared shape, and no integer input sets a shape
        (partitioner.shapes.shape_feeding_inputs); a head that does not run on them leaves
        the tail without inputs, not failed. Otherwise each engine warms up only where
        that is safe ([Note: any shape] in workers/engine.py)."""
        samples = self.sample_inputs()
        made = samples is None
        if made:
            samples = self.shaped_inputs()
        if samples is None:
            return None
        from partitioner import PartitionError, run_segments

        cut = self.resolve_cut(cut_id, known)
        head, tail = self.splitter().split(cut, check=False)
        try:
            env = run_segments([head], samples, name=f"{self.model}@{self.version}")
        except PartitionError as e:
            if made:
                logger.warning("%s@%s: the head of cut %s does not run on random inputs at input_shapes (%s); its "
                               "tail warms up without them", self.model, self.version, cut_id, e)
                return None
            raise RegistryError(path=os.path.join(self.path, self.config.sample_inputs),
                                reason=f"the head of cut {cut_id} does not run on the sample inputs ({e})",
                                fix="give sample inputs the model runs on") from e
        return {name: env[name] for name in tail.inputs}

    # -- profiles and frontier --------------------------------------------------------

    def profiles(self) -> dict[str, str]:
        """profiles/*.json file name -> text."""
        d = os.path.join(self.path, "profiles")
        out = {}
        if os.path.isdir(d):
            for name in sorted(os.listdir(d)):
                if name.endswith(".json"):
                    with open(os.path.join(d, name), encoding="utf-8") as fh:
                        out[name] = fh.read()
        return out

    def splitter(self) -> Any:
        """The partitioner's Splitter for this model (built once; loading checks the model)."""
        with self._lock:
            if self._splitter is None:
                from partitioner import PartitionError, Splitter

                try:
                    splitter = Splitter(self.model_path)
                except (PartitionError, OSError, ValueError) as e:
                    raise RegistryError(path=self.model_path, reason=f"is not a model the partitioner can read ({e})",
                                        fix="export a valid ONNX model") from e
                except Exception as e:  # onnx raises DecodeError and others for a corrupt file
                    raise RegistryError(path=self.model_path, reason=f"cannot be parsed as ONNX ({type(e).__name__})",
                                        fix="export a valid ONNX model") from e
                self._splitter = self._with_recorded_ranks(splitter)
            return self._splitter

    def _with_recorded_ranks(self, splitter: Any) -> Any:
        """``splitter``, or one whose graph takes the ranks that ONNX inference lost from a run
        on model.yaml's sample_inputs or input_shapes, with every dim but the batch left
        symbolic: tails still serve any size ([Note: planned at the declared shapes] in
        cluster/_registry_sizes.py says why tails are not cut at the declared sizes)."""
        if all(t.shape is not None for t in splitter.graph.tensors):
            return splitter
        samples = self.sample_inputs()
        if samples is None and not self.config.input_shapes:
            return splitter
        from cluster._registry_sizes import sized_graph
        from partitioner import PartitionError, Splitter
        from partitioner.export import with_recorded_ranks

        try:
            sized = sized_graph(self.model_path, splitter.graph, input_shapes=self.config.input_shapes,
                                samples=samples)
        except PartitionError as e:
            logger.warning("%s: ranks that ONNX inference lost are not recorded: %s", self.model_path, e)
            return splitter
        if sized is splitter.graph:
            return splitter
        return Splitter(splitter.model, with_recorded_ranks(splitter.graph, sized))

    def sized_graph(self) -> Any:
        """The splitter's layer graph with sizes from model.yaml's input_shapes and
        sample_inputs, for planning ([Note: planned at the declared shapes] in cluster/_registry_sizes.py)."""
        from cluster._registry_sizes import sized_graph
        from partitioner import PartitionError

        try:
            return sized_graph(self.model_path, self.splitter().graph, input_shapes=self.config.input_shapes,
                               samples=self.sample_inputs())
        except PartitionError as e:
            raise RegistryError(path=os.path.join(self.path, "model.yaml"), reason=f"the model's graph cannot be "
                                f"built at its input_shapes and sample_inputs ({e})",
                                fix="declare shapes and sample inputs that the model runs on") from e

    def _frontier_digest(self, table: str | None) -> str:
        """[Note: frontier inputs] frontier.json holds a digest of what it was computed from:
        model.onnx's size and modification time, the text of model.yaml (input shapes, the
        frontier settings, the budget), of profiles/*.json and of the accuracy table in use,
        and the sample inputs file's size and modification time. A frontier whose digest
        differs is computed again, so changing any of them (not only model.onnx) re-plans."""
        h = hashlib.sha256()
        for path, by_content in ((self.model_path, False), (os.path.join(self.path, "model.yaml"), True),
                                 (table, True),
                                 (os.path.join(self.path, self.config.sample_inputs)
                                  if self.config.sample_inputs else None, False)):
            if path is None or not os.path.isfile(path):
                h.update(b"-\0")
            elif by_content:
                with open(path, "rb") as fh:
                    h.update(fh.read() + b"\0")
            else:
                st = os.stat(path)
                h.update(f"{st.st_size} {st.st_mtime_ns}\0".encode())
        for name, text in self.profiles().items():
            h.update(f"{name}\0{text}\0".encode())
        return h.hexdigest()

    def frontier(self) -> VersionFrontier:
        """frontier.json if it was computed from the files there now, else computed and written back."""
        path = os.path.join(self.path, "frontier.json")
        cached = self._find("frontier.json")
        budget = self.config.min_agreement
        table = self._find("accuracy.json") if budget is not None else None
        digest = self._frontier_digest(table)
        if cached:
            try:
                with open(cached, encoding="utf-8") as fh:
                    front = VersionFrontier.from_json(fh.read())
                if front.inputs_digest == digest and front.min_agreement == budget:
                    return front
            except (ValueError, KeyError, TypeError) as e:
                logger.warning("ignoring %s (%s); computing the frontier again", cached, e)
        graph = self.sized_graph()
        try:
            front = compute_frontier(graph, self.config.frontier, self.profiles(), min_agreement=budget,
                                     accuracy=self.accuracy() if budget is not None else None)
        except ClusterError:
            raise
        except Exception as e:  # noqa: BLE001 - planner and profile errors name their own fields
            raise RegistryError(path=os.path.join(self.path, "profiles"),
                                reason=f"the frontier could not be computed: {e}",
                                fix="fix the profiles or remove them to use the default chain cuts") from e
        front = dataclasses.replace(front, inputs_digest=digest)
        self._write("frontier.json", front.to_json().encode())
        logger.info("%s@%s: frontier (%s) has %d cuts written to %s", self.model, self.version, front.source,
                    len(front.cuts), os.path.dirname(path))
        return front

    # -- accuracy ---------------------------------------------------------------------

    def accuracy(self) -> Any:
        """accuracy.json as a `planner.accuracy.AccuracyTable`; None when there is none, or
        when it is older than model.onnx (it measured another model)."""
        found = self._find("accuracy.json")
        if not found:
            return None
        if os.path.getmtime(found) < os.path.getmtime(self.model_path):
            logger.warning("%s is older than model.onnx; ignoring it (run splitinfer calibrate again)", found)
            return None
        from planner import PlannerError
        from planner.accuracy import AccuracyTable

        with open(found, encoding="utf-8") as fh:
            text = fh.read()
        try:
            return AccuracyTable.from_json(text)
        except (PlannerError, KeyError, TypeError, ValueError) as e:
            raise RegistryError(path=found, reason=f"is not an accuracy table ({e})",
                                fix=f"measure it again: splitinfer calibrate {self.model}@{self.version} "
                                    "--registry ROOT") from e

    def write_accuracy(self, table: Any) -> str:
        """Writes accuracy.json beside the model (or to the cache directory if read-only)."""
        return self._write("accuracy.json", table.to_json(indent=1, sort_keys=True).encode())

    # -- segments ---------------------------------------------------------------------

    def _fallback_dir(self) -> str:
        if self._cache_dir is None:
            self._cache_dir = tempfile.mkdtemp(prefix="splitinfer-registry-")
        return os.path.join(self._cache_dir, self.model, self.version)

    def _find(self, rel: str) -> str | None:
        for base in (self.path, self._fallback_dir() if self._cache_dir else None):
            if base and os.path.exists(os.path.join(base, rel)):
                return os.path.join(base, rel)
        return None

    def _write(self, rel: str, data: bytes) -> str:
        """Writes next to the model, or to the cache directory when the registry is read-only."""
        for base in (self.path, self._fallback_dir()):
            target = os.path.join(base, rel)
            try:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                tmp = f"{target}.tmp{os.getpid()}.{threading.get_ident()}"
                with open(tmp, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, target)  # atomic: a concurrent reader sees all or nothing
                return target
            except OSError as e:
                logger.debug("cannot write %s (%s); trying the cache directory", target, e)
        raise RegistryError(path=rel, reason="could not be written to the registry nor the cache directory",
                            fix="give the gateway a writable --cache-dir")

    def resolve_cut(self, cut_id: str, known: Sequence[str] = ()) -> Any:
        """The partitioner Cut with this id: a cached segment's, the valid cut a range id
        names (any cut can be served on demand), or a candidate cut for a hashed id."""
        from cluster.errors import UnknownCutError
        from partitioner import Cut, PartitionError, candidate_cuts, make_cut

        meta = self._find(os.path.join("segments", cut_id, "cut.json")) if NAME_PATTERN.match(cut_id) else None
        if meta:
            with open(meta, encoding="utf-8") as fh:
                return Cut.from_dict(json.load(fh))
        graph = self.splitter().graph
        named = Cut.from_key(cut_id)
        if named is not None:
            try:
                return make_cut(graph, named.device)
            except PartitionError as e:
                raise UnknownCutError(model=self.model, version=self.version, cut_id=cut_id, known=list(known)) from e
        with self._lock:
            if self._cut_index is None:
                self._cut_index = {c.key: c for c in candidate_cuts(graph) if len(c.device) < len(graph)}
            cut = self._cut_index.get(cut_id)
        if cut is None:
            raise UnknownCutError(model=self.model, version=self.version, cut_id=cut_id, known=list(known))
        return cut

    def remember_cut(self, cut: Any) -> None:
        """Records a cut under its id (segments/<id>/cut.json) so `resolve_cut` finds it later;
        for hashed ids, which name no layers, of cuts that are not candidate cuts (a DAG plan)."""
        rel = os.path.join("segments", cut.key, "cut.json")
        if not self._find(rel):
            self._write(rel, json.dumps(cut.to_dict()).encode())

    def tail_path(self, cut_id: str, known: Sequence[str] = ()) -> str:
        """segments/<cut_id>/tail.onnx, cut from the model on first use. Blocking: run it off the loop."""
        rel = os.path.join("segments", cut_id, "tail.onnx")
        found = self._find(rel) if NAME_PATTERN.match(cut_id) else None
        if found:
            return found
        cut = self.resolve_cut(cut_id, known)
        from partitioner import save_segment

        _, tail = self.splitter().split(cut)
        with tempfile.TemporaryDirectory() as tmp:
            p = os.path.join(tmp, "tail.onnx")
            save_segment(tail, p)
            with open(p, "rb") as fh:
                data = fh.read()
        path = self._write(rel, data)
        meta = dict(cut.to_dict(), inputs=list(tail.inputs), outputs=list(tail.outputs))
        self._write(os.path.join("segments", cut_id, "cut.json"), json.dumps(meta).encode())
        logger.info("%s@%s: cut tail %s (%d layers) to %s", self.model, self.version, cut_id,
                    len(tail.layers), path)
        return path

    def artifact_files(self) -> dict[str, bytes]:
        """What an edge agent needs to start: the model, model.yaml and its sample inputs,
        profiles, the frontier and the accuracy table when there is one."""
        out: dict[str, bytes] = {}
        with open(self.model_path, "rb") as fh:
            out["model.onnx"] = fh.read()
        yml = os.path.join(self.path, "model.yaml")
        if os.path.exists(yml):
            with open(yml, "rb") as fh:
                out["model.yaml"] = fh.read()
        samples = os.path.join(self.path, self.config.sample_inputs) if self.config.sample_inputs else ""
        if samples and os.path.isfile(samples):  # the agent plans at their sizes (edge_agent/model_inputs.py)
            with open(samples, "rb") as fh:
                out[self.config.sample_inputs] = fh.read()
        for name, text in self.profiles().items():
            out[f"profiles/{name}"] = text.encode()
        out["frontier.json"] = self.frontier().to_json().encode()
        accuracy = self._find("accuracy.json")
        if accuracy:
            with open(accuracy, "rb") as fh:
                out["accuracy.json"] = fh.read()
        return out
