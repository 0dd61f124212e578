"""`splitinfer edge ...`: run the edge agent daemon, or check its config.

    splitinfer edge run --config edge.yaml [--log-level info]
    splitinfer edge check --config edge.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

__all__ = ["edge_main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitinfer edge", description="the edge agent daemon")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("run", "run the agent until SIGTERM"), ("check", "load and print the config, then exit")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--config", required=True, help="path of edge.yaml")
        s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def edge_main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    from edge_agent.config import load_config

    config = load_config(args.config)
    if args.cmd == "check":
        print(config.redacted().to_json())
        return 0
    from edge_agent.daemon import run_agent

    return asyncio.run(run_agent(config))


if __name__ == "__main__":
    sys.exit(edge_main(sys.argv[1:]))
