"""What a node with subgraphs (If, Loop, Scan, ...) reads and holds.

[Note: outer-scope reads]
A subgraph may read any value of the scopes around it by name, without listing it as a
node input: an ``If`` branch computing ``MatMul(h, W)`` reads the top-level activation
``h`` and initializer ``W`` that way. Those reads are dependencies of the node exactly
like its inputs: the producer of ``h`` must run first, a segment holding the node must
receive ``h`` (or hold its producer) and must keep ``W``. `node_reads` is a node's
inputs plus those outer reads, gathered recursively through nested subgraphs; a name
that a subgraph defines itself (its inputs, initializers and node outputs) is not an
outer read of it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

__all__ = ["subgraphs", "node_reads", "subgraph_outer_reads", "subgraph_ops", "subgraph_weight_bytes"]


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs in a node's GRAPH and GRAPHS attributes, in attribute order."""
    out: list[onnx.GraphProto] = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def node_reads(node: onnx.NodeProto) -> list[str]:
    """Every name a node reads: its non-empty inputs, then the names its subgraphs read
    from enclosing scopes (see [Note: outer-scope reads]), each once, in first-read order."""
    reads = dict.fromkeys(x for x in node.input if x)
    for g in subgraphs(node):
        reads.update(dict.fromkeys(subgraph_outer_reads(g)))
    return list(reads)


def subgraph_outer_reads(graph: onnx.GraphProto) -> list[str]:
    """Names a subgraph (and the graphs nested in it) reads from enclosing scopes, each
    once, in first-read order. A graph output may name an outer value directly."""
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    defined |= {s.values.name for s in graph.sparse_initializer}
    defined |= {o for n in graph.node for o in n.output if o}
    reads: dict[str, None] = {}
    for n in graph.node:
        reads.update((x, None) for x in node_reads(n) if x not in defined)
    reads.update((o.name, None) for o in graph.output if o.name and o.name not in defined)
    return list(reads)


def subgraph_ops(node: onnx.NodeProto) -> set[tuple[str, str]]:
    """(domain, op_type) of every node inside the node's subgraphs, recursively."""
    out: set[tuple[str, str]] = set()
    for g in subgraphs(node):
        for n in g.node:
            out.add((n.domain, n.op_type))
            out |= subgraph_ops(n)
    return out


def subgraph_weight_bytes(node: onnx.NodeProto) -> int:
    """Bytes of the weights a node's subgraphs hold, recursively: their initializers and
    the tensors of their Constant nodes. Outer initializers a subgraph reads are not
    included; the caller counts those with the node's other reads."""
    total = 0
    for g in subgraphs(node):
        total += sum(_tensor_bytes(t) for t in g.initializer)
        for n in g.node:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                total += _constant_bytes(n)
            total += subgraph_weight_bytes(n)
    return total


def _tensor_bytes(t: onnx.TensorProto) -> int:
    try:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except Exception:  # string or unknown element types hold no fixed-size weights
        return 0
    return int(np.prod(t.dims, dtype=np.int64)) * itemsize


def _constant_bytes(node: onnx.NodeProto) -> int:
    """Bytes of a Constant node's value (float32 for value_float(s), int64 for value_int(s))."""
    for a in node.attribute:
        if a.name == "value":
            return _tensor_bytes(a.t)
        if a.name == "sparse_value":
            return _tensor_bytes(a.sparse_tensor.values) + _tensor_bytes(a.sparse_tensor.indices)
        if a.name == "value_float":
            return 4
        if a.name == "value_floats":
            return 4 * len(a.floats)
        if a.name == "value_int":
            return 8
        if a.name == "value_ints":
            return 8 * len(a.ints)
    return 0
