"""What a registry directory holds, held against the layout the gateway reads.

`cluster.registry` re-exports it; `splitinfer gateway` checks a registry with it before
starting, and `splitinfer registry list` shows it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from cluster._registry_disk import NAME_PATTERN, RegistryError, version_sort_key

__all__ = ["LAYOUT", "Survey", "survey"]

#: The layout of a registry, as messages state it.
LAYOUT = "<name>/<version>/model.onnx + model.yaml"


@dataclass(frozen=True)
class Survey:
    """What a registry directory holds, held against the layout the gateway reads."""

    root: str
    models: Mapping[str, tuple[str, ...]]
    """model -> its versions that hold a model.onnx, highest first."""
    problems: tuple[str, ...]
    """Each entry that does not fit the layout, as 'path: what is wrong; the fix'."""
    entries: tuple[str, ...]
    """The top-level names (not hidden) found in `root`."""

    def found(self) -> str:
        """What `root` holds, in a few words, for an error message when `models` is empty."""
        if not self.entries:
            return "is empty"
        if self.problems:
            more = f" (and {len(self.problems) - 3} more)" if len(self.problems) > 3 else ""
            return "holds no servable model: " + " / ".join(self.problems[:3]) + more
        shown = ", ".join(self.entries[:5]) + (", ..." if len(self.entries) > 5 else "")
        return f"holds no model directory (found: {shown})"


def survey(root: str) -> Survey:
    """Reads the directory tree of a registry (it loads no model) and says what fits the layout
    `<name>/<version>/model.onnx`. Raises RegistryError when `root` is not a directory."""
    if not os.path.isdir(root):
        reason = "is a file, not a directory" if os.path.exists(root) else "does not exist"
        raise RegistryError(path=root, reason=reason, fix="point it at the directory holding "
                                                          "<name>/<version>/model.onnx")
    models: dict[str, tuple[str, ...]] = {}
    problems: list[str] = []
    entries = sorted(n for n in os.listdir(root) if not n.startswith("."))
    for name in entries:
        d = os.path.join(root, name)
        if not os.path.isdir(d):
            if name.endswith(".onnx"):
                problems.append(f"{name}: a model outside any <name>/<version>/ directory; "
                                f"move it to <name>/1/model.onnx")
            continue
        if not NAME_PATTERN.match(name):
            problems.append(f"{name}/: not a valid model name; rename it to letters, digits, '.', '_', '-'")
            continue
        good, inside = [], sorted(os.listdir(d))
        for v in inside:
            vd = os.path.join(d, v)
            if v.endswith(".onnx") and os.path.isfile(vd):
                problems.append(f"{name}/{v}: not in a version directory; move it to {name}/1/model.onnx")
            elif not os.path.isdir(vd) or v.startswith("."):
                continue
            elif not NAME_PATTERN.match(v):
                problems.append(f"{name}/{v}/: not a valid version name; rename it, such as {name}/1/")
            elif not os.path.isfile(os.path.join(vd, "model.onnx")):
                problems.append(f"{name}/{v}/: no model.onnx; copy the model there as model.onnx")
            else:
                good.append(v)
        if good:
            models[name] = tuple(sorted(good, key=version_sort_key, reverse=True))
        elif not any(p.startswith(f"{name}/") for p in problems):
            problems.append(f"{name}/: no version directories; put the model in {name}/1/model.onnx")
    return Survey(root, models, tuple(problems), tuple(entries))
