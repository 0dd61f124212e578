"""How closely a converted model's outputs agree with the fp32 model's, with a metric
that fits each output. Pure numpy: no model is run here.

Metrics (``Metric``), each a number in [0, 1] except ``rel_l2``:

* ``top1``: class vectors ``[N, C]`` (or ``[N, C, 1, 1]``): the fraction of samples whose
  arg-max class is fp32's.
* ``argmax_per_position``: sequences ``[N, T, C]`` / ``[T, N, C]`` (arg-max over the last
  axis) and per-pixel class maps ``[N, C, H, W]`` (arg-max over axis 1): the fraction of
  positions whose arg-max is fp32's.
* ``iou``: dense maps (score, probability or heat maps ``[N, C, H, W]``): the
  intersection over union of ``map > threshold`` with fp32's, per sample, averaged
  (a sample where both maps are empty agrees fully). The threshold is 0.5 when fp32's
  values lie in [0, 1] (probabilities), else fp32's own mean.
* ``rel_l2``: anything else (box regressions, embeddings, hidden states, one value per
  sample): ``||candidate - fp32|| / ||fp32||`` over all elements, an error (lower is
  closer).
* ``exact``: integer and boolean outputs (labels, indices): the fraction of equal
  elements.

``agreement`` puts them on one scale for budgets and for naming the worst output: the
fraction itself, or ``max(0, 1 - rel_l2)`` (a relative error of 1% counts as 0.99).

[Note: how the metric is picked]
:func:`pick_metric` reads fp32's output, its batch axis first (``[N, C, 1, ..., 1]``
counts as ``[N, C]``):

1. not a float dtype: ``exact``;
2. rank 1, or one value per sample: ``rel_l2``;
3. rank 2 ``[N, C]``: ``top1``, unless its rows have unit L2 norm (an embedding) or
   ``C <= 4`` and the rows are not a distribution (coordinates, a box): ``rel_l2``;
4. rank 3: ``argmax_per_position`` when the last axis is a distribution (probabilities
   summing to 1, or log-probabilities); else ``iou`` when every value lies in [0, 1]
   (a probability map ``[N, H, W]``); else ``rel_l2`` (YOLO-style rows of box, score
   and classes; hidden states);
5. rank 4 ``[N, C, H, W]``: ``argmax_per_position`` over axis 1 when ``C >= 2`` and
   axis 1 is a distribution (segmentation); else ``iou`` when every value lies in
   [0, 1] (score, probability and heat maps); else ``rel_l2`` (feature maps,
   spectrograms, images, depth);
6. any other rank: ``rel_l2``.

Raw logits cannot be told from other numbers by their values, so a sequence or a map of
logits gets ``rel_l2`` (stricter, never flattering); name the metric to override any
choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from workers.errors import QuantizeConfigError

__all__ = [
    "METRICS",
    "AccuracyStats",
    "Metric",
    "OutputAgreement",
    "argmax_agreement",
    "compare_runs",
    "exact_agreement",
    "iou_agreement",
    "iou_threshold",
    "measure_output",
    "pick_metric",
    "relative_l2",
    "summarize",
    "top1_agreement",
]

Metric = Literal["top1", "argmax_per_position", "iou", "rel_l2", "exact"]
METRICS: tuple[str, ...] = ("top1", "argmax_per_position", "iou", "rel_l2", "exact")

_DIST_TOL = 1e-3  # softmax outputs in fp32 sum to 1 within ~1e-6; exporters' fp16 within ~1e-3
_UNIT_NORM_TOL = 1e-3
_MAX_COORD_WIDTH = 4  # [N, <=4] rows that are not a distribution: coordinates or a box


@dataclass(frozen=True)
class OutputAgreement:
    """One output of the converted model against fp32's."""

    output_name: str
    """The output compared."""

    metric: Metric
    """The metric used (see the module's note on how it is picked)."""

    value: float
    """The metric's value: a fraction in [0, 1], or the relative L2 error for rel_l2."""

    agreement: float
    """In [0, 1], higher is closer: ``value``, or ``max(0, 1 - value)`` for rel_l2."""

    threshold: float | None
    """The threshold of both maps for iou; None for the other metrics."""

    num_samples: int
    """Samples compared: rows along the first axis, over all runs."""

    max_abs_error: float
    """Largest |converted - fp32| over all elements (0 for exact)."""

    mean_abs_error: float
    """Mean |converted - fp32| over all elements (0 for exact)."""


@dataclass(frozen=True)
class AccuracyStats:
    """Every compared output of a converted model, and the one that agrees least."""

    num_samples: int
    """Samples compared (rows along the batch axis, over all runs)."""

    outputs: tuple[OutputAgreement, ...]
    """One entry per compared output, in the model's output order."""

    worst_output: str | None
    """The output with the lowest ``agreement``; None when nothing was compared."""

    agreement: float | None
    """The worst output's ``agreement``: the figure to hold against a budget."""

    def output(self, name: str) -> OutputAgreement:
        """The entry of output ``name``."""
        for entry in self.outputs:
            if entry.output_name == name:
                return entry
        raise KeyError(f"output {name!r} was not compared; compared: "
                       f"{[e.output_name for e in self.outputs]}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AccuracyStats:
        """Reads :meth:`to_dict`'s form, and the older one-output form
        (``output_name``, ``top1_agreement``, ``max_abs_error``, ``mean_abs_error``):
        its top-1 becomes a ``top1`` entry; without a top-1 it measured no agreement,
        and reads as no entry."""
        if "outputs" in data:
            outputs = tuple(OutputAgreement(**o) for o in data["outputs"])
            return cls(num_samples=int(data["num_samples"]), outputs=outputs,
                       worst_output=data["worst_output"], agreement=data["agreement"])
        top1 = data.get("top1_agreement")
        legacy = () if top1 is None else (OutputAgreement(
            output_name=data["output_name"], metric="top1", value=float(top1),
            agreement=float(top1), threshold=None, num_samples=int(data["num_samples"]),
            max_abs_error=float(data["max_abs_error"]),
            mean_abs_error=float(data["mean_abs_error"])),)
        return summarize(legacy, num_samples=int(data["num_samples"]))


def summarize(outputs: Sequence[OutputAgreement], *, num_samples: int) -> AccuracyStats:
    """The :class:`AccuracyStats` of these outputs: the worst is the lowest agreement
    (the first such in output order)."""
    worst = min(outputs, key=lambda o: o.agreement, default=None)
    return AccuracyStats(
        num_samples=num_samples, outputs=tuple(outputs),
        worst_output=None if worst is None else worst.output_name,
        agreement=None if worst is None else worst.agreement,
    )


def compare_runs(
    reference: Sequence[Mapping[str, np.ndarray]],
    candidate: Sequence[Mapping[str, np.ndarray]],
    *,
    metrics: Mapping[str, str] | None = None,
    num_samples: int | None = None,
) -> AccuracyStats:
    """Compares every output of the reference runs (one dict of output name to array
    per run) with the candidate's, each in the metric that fits it or the one
    ``metrics`` names. ``num_samples`` defaults to the first output's."""
    if len(reference) != len(candidate) or not reference:
        raise QuantizeConfigError(
            f"{len(candidate)} candidate runs against {len(reference)} reference runs; give "
            "one or more runs of both, on the same inputs",
            field_name="candidate", value=len(candidate),
        )
    names = list(reference[0])
    for k, run in enumerate(candidate):
        if set(run) != set(names):
            raise QuantizeConfigError(
                f"candidate #{k} has outputs {sorted(run)} but the reference has "
                f"{sorted(names)}; compare the same outputs",
                field_name="candidate", value=sorted(run),
            )
    metrics = metrics or {}
    entries = [measure_output(n, [r[n] for r in reference], [c[n] for c in candidate],
                              metric=metrics.get(n)) for n in names]
    if num_samples is None:
        num_samples = entries[0].num_samples if entries else 0
    return summarize(entries, num_samples=num_samples)


# -- picking ----------------------------------------------------------------------------


def _squeeze_trailing(x: np.ndarray) -> np.ndarray:
    """[N, C, 1, ..., 1] -> [N, C]; any other shape as it is."""
    if x.ndim > 2 and all(d == 1 for d in x.shape[2:]):
        return x.reshape(x.shape[:2])
    return x


def _is_distribution(x: np.ndarray, axis: int) -> bool:
    """Probabilities along ``axis`` (non-negative, summing to 1) or log-probabilities
    (non-positive, log-sum-exp 0)."""
    if x.size == 0 or x.shape[axis] < 2 or not np.all(np.isfinite(x)):
        return False
    x = x.astype(np.float64)
    if x.min() >= -_DIST_TOL:
        return bool(np.all(np.abs(x.sum(axis=axis) - 1.0) <= _DIST_TOL))
    if x.max() <= _DIST_TOL:
        peak = x.max(axis=axis, keepdims=True)
        lse = np.log(np.exp(x - peak).sum(axis=axis)) + np.squeeze(peak, axis=axis)
        return bool(np.all(np.abs(lse) <= _DIST_TOL))
    return False


def _in_unit_interval(x: np.ndarray) -> bool:
    return x.size > 0 and bool(x.min() >= 0.0) and bool(x.max() <= 1.0)


def pick_metric(reference: np.ndarray) -> Metric:
    """The metric that fits fp32's output ``reference`` (batch axis first). The rule is
    the module's note [how the metric is picked]."""
    x = np.asarray(reference)
    if not np.issubdtype(x.dtype, np.floating):
        return "exact"
    x = _squeeze_trailing(x)
    if x.ndim < 2 or x.size == 0 or x[0].size == 1:
        return "rel_l2"
    if x.ndim == 2:
        if _is_distribution(x, axis=1):
            return "top1"
        norms = np.linalg.norm(x.astype(np.float64), axis=1)
        if np.all(np.abs(norms - 1.0) <= _UNIT_NORM_TOL) or x.shape[1] <= _MAX_COORD_WIDTH:
            return "rel_l2"
        return "top1"
    if x.ndim == 3:
        if _is_distribution(x, axis=-1):
            return "argmax_per_position"
        return "iou" if _in_unit_interval(x) else "rel_l2"
    if x.ndim == 4:
        if x.shape[1] >= 2 and _is_distribution(x, axis=1):
            return "argmax_per_position"
        return "iou" if _in_unit_interval(x) else "rel_l2"
    return "rel_l2"


# -- the metrics on one pair of arrays --------------------------------------------------


def _check_pair(reference: np.ndarray, candidate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ref, cand = np.asarray(reference), np.asarray(candidate)
    if ref.shape != cand.shape:
        raise QuantizeConfigError(
            f"candidate has shape {cand.shape} but the reference has {ref.shape}; compare "
            "the same output of both models on the same inputs",
            field_name="candidate", value=cand.shape,
        )
    return ref, cand


def top1_agreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Fraction of samples (first axis) whose arg-max over the rest is the same."""
    ref, cand = _check_pair(reference, candidate)
    ref, cand = ref.reshape(len(ref), -1), cand.reshape(len(cand), -1)
    if not len(ref):
        return 1.0
    return float(np.mean(ref.argmax(axis=1) == cand.argmax(axis=1)))


def argmax_agreement(reference: np.ndarray, candidate: np.ndarray, axis: int = -1) -> float:
    """Fraction of positions whose arg-max along ``axis`` is the same."""
    ref, cand = _check_pair(reference, candidate)
    same = ref.argmax(axis=axis) == cand.argmax(axis=axis)
    return float(np.mean(same)) if same.size else 1.0


def iou_threshold(reference: np.ndarray) -> float:
    """0.5 when every value of ``reference`` lies in [0, 1] (probabilities), else its mean."""
    ref = np.asarray(reference, dtype=np.float64)
    return 0.5 if _in_unit_interval(ref) else float(ref.mean()) if ref.size else 0.0


def _iou_sum(ref: np.ndarray, cand: np.ndarray, threshold: float) -> tuple[float, int]:
    """Sum over samples of the IoU of ``> threshold``, and the number of samples."""
    a = (ref > threshold).reshape(len(ref), -1)
    b = (cand > threshold).reshape(len(cand), -1)
    inter = np.logical_and(a, b).sum(axis=1)
    union = np.logical_or(a, b).sum(axis=1)
    iou = np.where(union > 0, inter / np.maximum(union, 1), 1.0)
    return float(iou.sum()), len(iou)


def iou_agreement(reference: np.ndarray, candidate: np.ndarray,
                  threshold: float | None = None) -> float:
    """Mean over samples of the IoU of ``map > threshold`` (``iou_threshold`` of the
    reference when None); 1 for a sample where both maps are empty."""
    ref, cand = _check_pair(reference, candidate)
    t = iou_threshold(ref) if threshold is None else threshold
    total, n = _iou_sum(ref, cand, t)
    return total / n if n else 1.0


def relative_l2(reference: np.ndarray, candidate: np.ndarray) -> float:
    """``||candidate - reference|| / ||reference||`` over all elements; 0 when both are
    zero, inf when only the reference is."""
    ref, cand = _check_pair(reference, candidate)
    return _rel_l2(float(np.sum(np.square(cand.astype(np.float64) - ref))),
                   float(np.sum(np.square(ref.astype(np.float64)))))


def _rel_l2(diff_sq: float, ref_sq: float) -> float:
    if ref_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else float("inf")
    return float(np.sqrt(diff_sq / ref_sq))


def exact_agreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Fraction of equal elements."""
    ref, cand = _check_pair(reference, candidate)
    return float(np.mean(ref == cand)) if ref.size else 1.0


# -- one output over many runs ----------------------------------------------------------


def measure_output(
    output_name: str,
    reference: Sequence[np.ndarray],
    candidate: Sequence[np.ndarray],
    *,
    metric: str | None = None,
    threshold: float | None = None,
) -> OutputAgreement:
    """Compares one output over runs (one array per run, batch axis first; runs may
    differ in shape). ``metric`` None picks one from the reference (see the module's
    note); ``threshold`` overrides iou's."""
    if metric is not None and metric not in METRICS:
        raise QuantizeConfigError(
            f"metric {metric!r} for output {output_name!r} is not one of {METRICS}",
            field_name="metrics", value=metric,
        )
    if len(reference) != len(candidate):
        raise QuantizeConfigError(
            f"{len(candidate)} candidate runs for output {output_name!r} but "
            f"{len(reference)} reference runs; compare the same runs",
            field_name="candidate", value=len(candidate),
        )
    pairs = [_check_pair(r, c) for r, c in zip(reference, candidate)]
    refs = [_squeeze_trailing(r) if r.ndim > 2 else r for r, _ in pairs]
    cands = [c.reshape(r.shape) for r, (_, c) in zip(refs, pairs)]
    if metric is None:
        metric = pick_metric(_stack_for_picking(refs))
    num_samples = sum(len(r) if r.ndim else 1 for r in refs)
    t: float | None = None
    if metric == "exact":
        same = sum(int(np.sum(r == c)) for r, c in zip(refs, cands))
        size = sum(r.size for r in refs)
        value = same / size if size else 1.0
        max_abs = mean_abs = 0.0
    else:
        f_refs = [r.astype(np.float64) for r in refs]
        f_cands = [c.astype(np.float64) for c in cands]
        value, t = _float_metric(metric, f_refs, f_cands, threshold)
        diffs = [np.abs(c - r) for r, c in zip(f_refs, f_cands)]
        size = sum(d.size for d in diffs)
        max_abs = max((float(d.max()) for d in diffs if d.size), default=0.0)
        mean_abs = sum(float(d.sum()) for d in diffs) / size if size else 0.0
    agreement = max(0.0, 1.0 - value) if metric == "rel_l2" else value
    return OutputAgreement(
        output_name=output_name, metric=metric, value=float(value),  # type: ignore[arg-type]
        agreement=float(agreement), threshold=t, num_samples=num_samples,
        max_abs_error=max_abs, mean_abs_error=mean_abs,
    )


def _stack_for_picking(refs: list[np.ndarray]) -> np.ndarray:
    """The runs as one array when their shapes allow, else the first run (the rule reads
    the rank and the value range, which the first run shows)."""
    if len({r.shape[1:] for r in refs}) == 1 and all(r.ndim for r in refs):
        return np.concatenate(refs, axis=0)
    return refs[0]


def _float_metric(metric: str, refs: list[np.ndarray], cands: list[np.ndarray],
                  threshold: float | None) -> tuple[float, float | None]:
    """The metric's value over all runs, and iou's threshold."""
    if metric == "rel_l2":
        diff_sq = sum(float(np.sum(np.square(c - r))) for r, c in zip(refs, cands))
        ref_sq = sum(float(np.sum(np.square(r))) for r in refs)
        return _rel_l2(diff_sq, ref_sq), None
    if metric == "iou":
        if threshold is None:
            bounded = all(_in_unit_interval(r) for r in refs)
            size = sum(r.size for r in refs)
            threshold = 0.5 if bounded else (sum(float(r.sum()) for r in refs) / size
                                             if size else 0.0)
        sums = [_iou_sum(r.reshape(len(r), -1), c.reshape(len(c), -1), threshold)
                for r, c in zip(refs, cands)]
        n = sum(k for _, k in sums)
        return (sum(s for s, _ in sums) / n if n else 1.0), float(threshold)
    same = total = 0
    for r, c in zip(refs, cands):
        if metric == "top1":
            a, b = r.reshape(len(r), -1).argmax(axis=1), c.reshape(len(c), -1).argmax(axis=1)
        else:  # argmax_per_position: axis 1 of a [N, C, H, W] map, else the last axis
            axis = 1 if r.ndim == 4 else -1
            a, b = r.argmax(axis=axis), c.argmax(axis=axis)
        same += int(np.sum(a == b))
        total += a.size
    return (same / total if total else 1.0), None
