"""`splitinfer instances`: how many engine instances a segment should run on this host.

    splitinfer instances MODEL [--after LAYER_ID] [--threads N] [--ep cpu] [--batch 8]
                         [--candidates 2,4] [--rounds 5] [--seconds 1.0]
                         [--margin 0.05] [--json OUT.json] [--model-yaml PATH] [--quiet]
                         [--input-shape NAME=D0xD1x...] [--inputs FILE.npz]

Times one engine with all ``--threads`` against N engines of threads/N each, side by
side, at the batch the worker forms, in rounds that time one engine before and after
every other setting (see [Note: choosing instances] in workers/profile/instances.py),
and prints the count to put in the model's model.yaml (``instances: N``) or
``PoolConfig(instances=N)``; ``--model-yaml`` writes it there (with the thread
budget it was measured at as ``intra_op_threads``). MODEL is a path to an .onnx file or a zoo short name
(seeded random weights); ``--after LAYER_ID`` times the tail that the cloud runs when
layers 0..LAYER_ID run on the device, as ``splitinfer split --after`` cuts it.
``--input-shape`` fixes symbolic input dims; ``--inputs`` gives sample inputs, whose
rows (or, with ``--after``, the boundary values they produce) every timed run uses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from splitinfer.model_inputs import add_input_args
from splitinfer.profile_cmd import _load, parse_batches
from splitinfer.units import int_at_least, parse_args

__all__ = ["instances_main"]


def _number(what: str, ok) -> Callable[[str], float]:
    """An argparse type: a float for which ``ok`` holds, else a usage error naming ``what``."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return v
    return parse


_seconds = _number("a number of seconds above 0, such as 1.0", lambda v: v > 0)
_margin = _number("a fraction from 0 up, such as 0.05", lambda v: 0 <= v < 10)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitinfer instances", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="path to an .onnx file or a zoo name (resnet50, densenet121, ...)")
    p.add_argument("--after", type=int, metavar="LAYER_ID",
                   help="time the tail after layers 0..LAYER_ID (the cloud's segment); default: the whole model")
    p.add_argument("--threads", type=int_at_least(1), default=os.cpu_count() or 1,
                   help="intra-op threads the worker gives the segment (default: this host's CPUs)")
    p.add_argument("--ep", choices=("cpu", "cuda", "tensorrt", "auto"), default="cpu",
                   help="execution provider of the engines (default cpu; auto takes a GPU where ORT has one)")
    p.add_argument("--batch", type=int_at_least(1), default=8, help="rows a run, the batch the worker forms (default 8)")
    p.add_argument("--candidates", type=parse_batches, default=(2,),
                   help="engine counts to try against one engine, e.g. 2,4 (default 2)")
    p.add_argument("--rounds", type=int_at_least(1), default=5, help="bracketed rounds (default 5)")
    p.add_argument("--seconds", type=_seconds, default=1.0, help="seconds per timed slice (default 1.0)")
    p.add_argument("--margin", type=_margin, default=0.05,
                   help="how much faster than one engine a setting must be to be chosen (default 0.05)")
    p.add_argument("--json", metavar="PATH", help="also write what was measured as JSON")
    p.add_argument("--model-yaml", metavar="PATH",
                   help="set instances (and intra_op_threads to --threads) in this registry model.yaml, keeping "
                        "its other lines; created if missing")
    p.add_argument("--quiet", action="store_true", help="no line per timed slice")
    add_input_args(p)
    return p


def instances_main(argv: Sequence[str]) -> int:
    args = parse_args(_parser(), argv)
    from partitioner import make_cut, split
    from partitioner.export import reference_outputs
    from splitinfer.partition_cmd import layers_through

    model, graph, given = _load(args.model, args)
    name = graph.model
    samples = given.inputs
    if args.after is not None:
        _, tail = split(model, make_cut(graph, layers_through(graph, args.after, need_tail=True)), graph=graph)
        if samples is not None:  # the tail runs on the boundary's real values
            samples = reference_outputs(model, tail.inputs, samples, name=graph.model)
            samples = {k: samples[k] for k in tail.inputs}
        model, name = tail.model, f"{name} after layer {args.after}"

    from workers.engine import EngineConfig
    from workers.profile.instances import time_instances

    # fatal only: a failed run is raised as one error naming the model; ORT's log line would repeat it
    config = EngineConfig(provider=args.ep, log_severity=4)
    choice = time_instances(model, name=name, engine_config=config, threads=args.threads, batch=args.batch, candidates=args.candidates,
                            rounds=args.rounds, slice_s=args.seconds, margin=args.margin, inputs=samples,
                            progress=None if args.quiet else lambda line: print(line, file=sys.stderr, flush=True))
    base = choice.baseline_per_s
    print(f"{name} on {choice.provider}: {choice.rows} row(s) a run, {args.threads} thread(s) in all, "
          f"{args.rounds} rounds of {args.seconds:g} s")
    print(f"  one engine of {args.threads} thread(s): {min(base):.1f}-{max(base):.1f} rows/s")
    for t in choice.timings:
        print(f"  {t.instances} engines of {t.threads_each} thread(s): {min(t.per_s):.1f}-{max(t.per_s):.1f} rows/s, "
              f"{t.median_ratio:.2f}x one engine (median of rounds {', '.join(f'{r:.2f}' for r in t.ratios)})")
    print(f"choice: instances: {choice.instances}  ({choice.reason})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(choice.to_dict(), f, indent=1)
        print(f"wrote {args.json}")
    if args.model_yaml:
        from cluster.registry import set_model_yaml

        config = set_model_yaml(args.model_yaml, instances=choice.instances, intra_op_threads=args.threads)
        print(f"wrote instances: {config.instances} and intra_op_threads: {config.intra_op_threads} "
              f"to {args.model_yaml} (every tail of that version runs with them)")
    return 0


if __name__ == "__main__":
    sys.exit(instances_main(sys.argv[1:]))
