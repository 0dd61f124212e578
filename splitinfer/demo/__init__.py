"""`splitinfer demo`: the whole system on one machine, on embedded defaults, in one command.

The command itself is `cli`; the parts it composes are the emulated edge device
(`edge`), the models, profiles and plans (`setup`), the local Ray, gateway and link
emulator (`stack`), the request stream (`stream`) and the report (`summary`).
"""

from __future__ import annotations

from splitinfer.demo.cli import main, make_parser

__all__ = ["main", "make_parser"]
