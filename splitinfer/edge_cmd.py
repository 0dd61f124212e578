"""`splitinfer edge ...`: run the edge agent daemon, check its config, or send it one input.

    splitinfer edge run --config edge.yaml [--emulate-device rpi4 | --emulate-slowdown X] [--emulate-link 10mbit[,rtt=5ms]]
    splitinfer edge run --gateway HOST:PORT --model NAME[@V] [--api-port N] [...]
    splitinfer edge check --config edge.yaml
    splitinfer edge infer [--url URL | --socket PATH] (--input FILE.npy|.npz | --random [--seed N])

With `--emulate-device` or `--emulate-slowdown` (or `emulate:` in edge.yaml) this host plays a
slower device: see splitinfer.emulate and docs/edge-agent.md, "Emulating a device".
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge_agent.config import EdgeConfig

__all__ = ["edge_main"]


def _link_spec(text: str) -> dict[str, str]:
    from splitinfer.emulate import parse_link_spec

    try:
        return parse_link_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _config_flags(s: argparse.ArgumentParser, *, run: bool) -> None:
    s.add_argument("--config", help="path of edge.yaml (optional with --gateway and --model)")
    s.add_argument("--gateway", metavar="HOST:PORT", help="gateway address (overrides the config's)")
    s.add_argument("--model", metavar="NAME[@VERSION]", help="model to serve (overrides the config's)")
    s.add_argument("--api-port", type=int, metavar="PORT", help="local API port (overrides the config's; default 8500)")
    s.add_argument("--api-socket", metavar="PATH", help="serve the local API on this unix socket instead")
    s.add_argument("--emulate-device", metavar="DEVICE",
                   help="play a slower reference device (rpi4, rpi5, ...): plan with its profile, its work stretched "
                        "in time to match")
    s.add_argument("--emulate-slowdown", type=float, metavar="X",
                   help="every engine run and encode takes X times its CPU time here (X >= 1)")
    s.add_argument("--emulate-link", type=_link_spec, metavar="RATE[,rtt=D][,down=RATE]",
                   help="put an emulated link between the agent and the gateway, e.g. 10mbit or 10mbit,rtt=5ms "
                        "(downlink 4x the uplink unless given)")
    if run:
        s.add_argument("--emulated-child", action="store_true", help=argparse.SUPPRESS)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitinfer edge", description="the edge agent daemon")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("run", "run the agent until SIGTERM"), ("check", "load and print the config, then exit")):
        s = sub.add_parser(name, help=help_)
        _config_flags(s, run=name == "run")
        s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    s = sub.add_parser("infer", help="send one input to a running agent and show the answer and where it ran")
    s.add_argument("--url", default="http://127.0.0.1:8500", help="the agent's local API (default %(default)s)")
    s.add_argument("--socket", metavar="PATH", help="the agent's unix socket (api_socket) instead of --url")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", metavar="FILE", help=".npy (the model's one input) or .npz (inputs by name)")
    src.add_argument("--random", action="store_true", help="a random input shaped as GET /v1/model says")
    s.add_argument("--seed", type=int, default=0, help="seed of --random (default 0)")
    s.add_argument("--top", type=int, default=5, metavar="K", help="classes shown for a class vector (default 5)")
    s.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for the agent to be ready (default: do not wait)")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    return p


def _load(args: argparse.Namespace) -> EdgeConfig:
    """The config from --config and the flags that override it."""
    from edge_agent.config import config_from_dict, load_config
    from edge_agent.errors import ConfigError
    from splitinfer.emulate import check_emulation

    flags: dict[str, Any] = {k: v for k, v in (("gateway", args.gateway), ("model", args.model),
                                                ("api_port", args.api_port), ("api_socket", args.api_socket),
                                                ("emulate_device", args.emulate_device),
                                                ("emulate_slowdown", args.emulate_slowdown)) if v is not None}
    if args.emulate_link is not None:
        flags.update(args.emulate_link, emulate_downlink=args.emulate_link.get("emulate_downlink"),
                     emulate_rtt=args.emulate_link.get("emulate_rtt"))
    if args.config is not None:
        config = load_config(args.config)
        if flags:
            try:
                config = dataclasses.replace(config, **flags)
            except ConfigError as e:
                raise ConfigError(key=e.key, reason=e.reason, fix=e.fix, path=f"{args.config} with the flags") from None
    elif args.gateway is None or args.model is None:
        raise ConfigError(key="--config", reason="is missing", fix="pass --config edge.yaml, or --gateway and --model")
    else:
        config = config_from_dict(flags, path="the flags")
    check_emulation(config)
    return config


def _run(args: argparse.Namespace) -> int:
    config = _load(args)
    if args.cmd == "check":
        print(config.redacted().to_json())
        return 0
    if config.emulate_uplink is not None and not args.emulated_child:  # the device is emulated by the agent itself
        from splitinfer.emulate import run_emulated

        return run_emulated(config, log_level=args.log_level)
    from edge_agent.daemon import run_agent
    from workers import keep_freed_memory

    # [Note: fresh pages] (workers/_malloc.py) holds for the agent's client too: on grpcio
    # 1.85.3 a 1 MiB Infer from a process at glibc's defaults took about 1 ms more.
    keep_freed_memory()
    return asyncio.run(run_agent(config))


def edge_main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    if args.cmd == "infer":
        from splitinfer.edge_infer import infer_main

        return infer_main(args)
    return _run(args)


if __name__ == "__main__":
    sys.exit(edge_main(sys.argv[1:]))
