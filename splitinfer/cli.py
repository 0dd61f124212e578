"""The `splitinfer` command line.

Thin on purpose: each subcommand lives in the module that owns it and is imported only
when it runs, so `splitinfer netem` never pays for ONNX Runtime and an edge device
without Ray can still run every edge command.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import logging
import re
import signal
import sys
import threading
from collections.abc import Sequence

__all__ = ["main", "Terminated", "check_extras", "extras_hint", "missing_extra_hint", "ort_failure",
           "COMMANDS", "EXTRA_OF_MODULE"]

# name -> (module, function, one-line help). Each function takes argv and returns an exit code.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("splitinfer.demo", "main", "run the end-to-end demo on embedded defaults"),
    "inspect": ("splitinfer.partition_cmd", "inspect_main", "show a model's layers, tensors and cut points"),
    "split": ("splitinfer.partition_cmd", "split_main", "cut a model into head.onnx and tail.onnx"),
    "profile": ("splitinfer.profile_cmd", "profile_main", "measure a model's per-layer profile on this host"),
    "calibrate": ("splitinfer.calibrate_cmd", "calibrate_main",
                  "measure the accuracy of every encoding at every candidate cut: the model's accuracy table"),
    "instances": ("splitinfer.instances_cmd", "instances_main",
                  "time engine instances side by side and choose how many a segment runs on this host"),
    "plan": ("splitinfer.plan_cmd", "plan_main", "choose the best cut for a device, a cloud and a link"),
    "sweep": ("splitinfer.plan_cmd", "sweep_main", "latency against uplink bandwidth, with a plot"),
    "planner": ("splitinfer.plan_cmd", "planner_main", "the what-if HTTP service: 'planner serve'"),
    "fleet": ("splitinfer.fleet_cmd", "fleet_main", "size a cloud tier for a fleet: 'fleet plan SPEC.yaml'"),
    "registry": ("splitinfer.registry_cmd", "registry_main",
                 "write a model into a registry the gateway serves: 'registry add MODEL REGISTRY'"),
    "gateway": ("splitinfer.gateway_cmd", "gateway_main", "the cloud gRPC gateway"),
    "edge": ("splitinfer.edge_cmd", "edge_main", "the edge agent daemon: 'edge run --config edge.yaml'"),
    "cluster": ("splitinfer.cluster_cmd", "cluster_main", "operate the cloud tier on Kubernetes: status, scale, rollout, rollback"),
    "bench": ("splitinfer.bench_cmd", "bench_main", "run a benchmark from a source checkout: 'bench e2e --quick'"),
    "netem": ("splitinfer.netem", "main", "user-space link emulator (TCP proxy with bandwidth, delay, outages)"),
}

# Root exceptions of the project's packages: printed as one clear line, never a traceback.
_OUR_PACKAGES = ("partitioner", "planner", "workers", "cluster", "edge_agent", "splitinfer")

# Top-level module -> the extra (pyproject.toml) that installs it. A command that stops on one
# of these missing says which extra to install, in one line, instead of a traceback.
EXTRA_OF_MODULE: dict[str, str] = {
    "ray": "cloud",
    "kubernetes": "cloud",
    "prometheus_client": "cloud",
    "onnxconverter_common": "cloud",
    "uvloop": "cloud",
    "sympy": "cloud",
    "scipy": "planner",
    "matplotlib": "plots",
    "pytest": "test",
    "hypothesis": "test",
    "sklearn": "test",
    "skl2onnx": "test",
    "schemathesis": "test",
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: splitinfer COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {n:<{width}}  {h}" for n, (_, _, h) in COMMANDS.items()]
    lines += ["", "Run 'splitinfer COMMAND --help' for a command's options."]
    return "\n".join(lines)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that a command unwinds as it does on Ctrl-C."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def extras_hint(modules: Sequence[str]) -> str:
    """"needs the 'cloud' extra (missing module 'ray'): pip install 'splitinfer[cloud]'" for
    missing modules that extras install (EXTRA_OF_MODULE)."""
    tops = sorted({m.split(".")[0] for m in modules})
    extras = sorted({EXTRA_OF_MODULE[t] for t in tops})
    what = (f"the {extras[0]!r} extra" if len(extras) == 1
            else "the " + ", ".join(repr(x) for x in extras[:-1]) + f" and {extras[-1]!r} extras")
    mods = ("module " if len(tops) == 1 else "modules ") + ", ".join(repr(t) for t in tops)
    return f"needs {what} (missing {mods}): pip install 'splitinfer[{','.join(extras)}]'"


def missing_extra_hint(error: BaseException) -> str | None:
    """The `extras_hint` for an import error, or for one it was raised from, of a module
    that an extra installs; None for any other error."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ImportError) and e.name and e.name.split(".")[0] in EXTRA_OF_MODULE:
            return extras_hint([e.name])
        e = e.__cause__ or e.__context__
    return None


# "[ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model ... failed: ..."
_ORT_MESSAGE = re.compile(r"^\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*(\w+)\s*:\s*(.*)$", re.DOTALL)


def _is_ort_error(error: BaseException) -> bool:
    # ONNX Runtime's exception types (Fail, InvalidGraph, ...) are not public: they live
    # in its compiled module, so they are known by that module or by their message.
    return (type(error).__module__.split(".")[0] == "onnxruntime"
            or str(error).startswith("[ONNXRuntimeError]"))


def ort_failure(error: BaseException, argv: Sequence[str] = ()) -> str | None:
    """One line for an ONNX Runtime failure, or for an error raised from one
    (``raise ... from``): "ONNX Runtime 1.x failed on MODEL: INVALID_GRAPH: ...", naming
    the first ``.onnx`` argument of ``argv`` as the model. None for any other error."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen and not _is_ort_error(e):
        seen.add(id(e))
        e = e.__cause__
    if e is None or id(e) in seen:
        return None
    text = str(e)
    match = _ORT_MESSAGE.match(text)
    if match:
        text = f"{match.group(1)}: {match.group(2)}"
    text = " ".join(text.split()) or type(e).__name__
    loaded = sys.modules.get("onnxruntime")
    runtime = " ".join(["ONNX Runtime", getattr(loaded, "__version__", "")]).strip()
    models = [a.split("=", 1)[-1] for a in argv if a.lower().endswith(".onnx")]
    where = f" on {models[0]}" if models else ""
    return f"{runtime} failed{where}: {text}"


def check_extras(modules: Sequence[str]) -> str | None:
    """The `extras_hint` for those of ``modules`` that are not installed, or None when all
    are: for a command that needs them late (after minutes of work) to say so at once."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return extras_hint(missing) if missing else None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"splitinfer {version('splitinfer')}")
        except PackageNotFoundError:
            print("splitinfer (not installed)")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"splitinfer: unknown command {name!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    module, func, _ = COMMANDS[name]
    # SIGTERM unwinds like Ctrl-C, so every `finally`, `with` and atexit clean-up runs (its
    # temporary directories removed) instead of the process vanishing; the servers replace
    # this with their own graceful stop while their loop runs.
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main else None
    try:
        fn = getattr(importlib.import_module(module), func)
        return int(fn(rest) or 0)
    except ImportError as e:
        hint = missing_extra_hint(e)
        if hint is None:
            raise
        print(f"splitinfer {name}: {hint}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"splitinfer {name}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"splitinfer {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the project's own errors and ONNX Runtime's become one line
        if type(e).__module__.split(".")[0] in _OUR_PACKAGES:
            print(f"splitinfer {name}: error: {e}", file=sys.stderr)
            return 2
        ort_line = ort_failure(e, rest)
        if ort_line is None:
            raise
        print(f"splitinfer {name}: error: {ort_line}", file=sys.stderr)
        return 2
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


if __name__ == "__main__":
    sys.exit(main())
