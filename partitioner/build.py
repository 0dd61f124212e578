"""ONNX model -> LayerGraph.

[Note: layer grouping]
A cut must never separate what ONNX Runtime would run as one kernel, and a layer must
carry the constants it needs, so grouping goes in three steps:

1. *Constants.* A node is constant when every input is an initializer or the output of
   another constant node (ConstantOfShape weight generators, Unsqueeze of a scale
   vector, Reshape shape constants). Constant nodes belong to no layer; each layer
   lists the constant sub-graph its nodes need (`Layer.const_nodes`), and each segment
   that holds the layer regenerates it. Their outputs count as the layer's parameters.
2. *Fusion.* A fusable node (BatchNorm, activations, elementwise arithmetic, Dropout
   and Identity, shape-only ops) joins the layer of its latest-produced activation
   input p when p is the last node of that layer and every output of p is read by this
   node alone (and is no model output). That is exactly when ONNX Runtime's Conv+BN,
   Conv+Add+Relu and Gemm+activation fusions can fire. Joining the *latest* producer
   keeps the layer graph acyclic: the other inputs come from nodes earlier in
   topological order, which cannot depend on p.
3. *Everything else* (Conv, Gemm, MatMul, pooling, Concat, Softmax, LRN, unknown ops)
   starts a new layer. Unknown ops are never an error.

Layers are then topologically sorted (fusion can make a layer read from a layer created
after it) and numbered in that order.

Every step reads a node's inputs *and* the outer-scope names its subgraphs read
(`node_reads`, [Note: outer-scope reads] in partitioner/subgraphs.py). An If, Loop or
Scan node is therefore one layer whose dependencies include what its branches and body
read; cuts never enter a subgraph, since layers are made of top-level nodes only. Its
parameters include the weights its subgraphs hold, and its FLOPs follow
[Note: control-flow FLOPs] in partitioner/flops.py.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from partitioner._infer import Inferred, infer_types, per_sample_factor
from partitioner.errors import PartitionError
from partitioner.flops import node_flops
from partitioner.graph import BATCH, UNKNOWN_DIM, Layer, LayerGraph, TensorInfo
from partitioner.subgraphs import node_reads, subgraph_ops, subgraph_outer_reads, subgraph_weight_bytes

__all__ = [
    "load_model", "build_graph", "node_names", "strip_weights", "node_reads", "subgraph_outer_reads",
    "FUSABLE_OPS",
]

log = logging.getLogger(__name__)

FUSABLE_OPS = frozenset(
    {
        # normalisation and activations
        "BatchNormalization", "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "Tanh",
        "HardSigmoid", "HardSwish", "Elu", "Selu", "Celu", "Softplus", "Softsign",
        "Gelu", "FastGelu", "Erf", "ThresholdedRelu", "Mish",
        # elementwise arithmetic
        "Add", "Sub", "Mul", "Div", "Sum", "Max", "Min", "Pow", "Sqrt", "Neg", "Abs",
        # no-ops at inference and shape-only moves
        "Dropout", "Identity", "Cast", "Flatten", "Reshape", "Squeeze", "Unsqueeze",
        "Transpose",
    }
)

# Ops that are random or stateful: never fold them as constants.
_NONDETERMINISTIC = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial"}
)


def load_model(path: str | os.PathLike[str], *, load_external_data: bool = True) -> onnx.ModelProto:
    """Read an ONNX file, with PartitionError for anything that is not a valid model."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PartitionError(f"model file {path!r} does not exist; give the path of an .onnx file")
    try:
        model = onnx.load(path, load_external_data=load_external_data)
    except Exception as e:  # protobuf raises DecodeError, others raise OSError/ValueError
        raise PartitionError(
            f"{path!r} is not a readable ONNX model ({type(e).__name__}: {e}); "
            "check that the file is a complete .onnx protobuf and not truncated",
            model=path,
        ) from e
    if not model.graph.node:
        raise PartitionError(
            f"{path!r} has no graph nodes: it is empty or not an ONNX model; "
            "export the model with its graph (e.g. torch.onnx.export) and try again",
            model=path,
        )
    return model


def node_names(model: onnx.ModelProto) -> list[str]:
    """A unique, stable name for every node (the model's own where it has one)."""
    names: list[str] = []
    seen: set[str] = set()
    for i, n in enumerate(model.graph.node):
        name = n.name or f"{n.op_type}_{i}"
        if name in seen:
            name = f"{name}__{i}"
        seen.add(name)
        names.append(name)
    return names


def _dtype_name(elem_type: int) -> str:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except Exception:  # unknown or string types
        return onnx.TensorProto.DataType.Name(elem_type).lower()


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 0


def _infer(
    model: onnx.ModelProto,
    name: str,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
) -> Inferred:
    """Dtype and shape of every tensor (see [Note: shape inference chain] in
    partitioner/_infer.py); never fails for want of a shape, which is then unknown."""
    return infer_types(model, name=name, input_shapes=input_shapes, inputs=inputs)


def strip_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose initializers keep name, dtype and dims but no bytes.

    Shape inference and the checker need only those; a model over 2 GB cannot even be
    serialised for them with its weights.
    """
    light = onnx.ModelProto()
    light.CopyFrom(model)
    for init in light.graph.initializer:
        init.ClearField("raw_data")
        init.data_location = onnx.TensorProto.DEFAULT
        del init.float_data[:]
    return light


def _toposort(model: onnx.ModelProto, known: set[str], name: str) -> list[int]:
    """Node indices in a topological order (the file's own order where it is one).

    A node depends on the producers of its inputs and of what its subgraphs read.
    """
    graph = model.graph
    producer: dict[str, int] = {}
    for i, n in enumerate(graph.node):
        for o in n.output:
            if o:
                producer[o] = i
    reads = [node_reads(n) for n in graph.node]
    deps: list[set[int]] = []
    for r in reads:
        deps.append({producer[x] for x in r if x in producer})
    order: list[int] = []
    state = [0] * len(graph.node)  # 0 new, 1 on stack, 2 done
    for root in range(len(graph.node)):
        if state[root]:
            continue
        stack = [(root, iter(sorted(deps[root])))]
        state[root] = 1
        while stack:
            i, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                state[i] = 2
                order.append(i)
            elif state[nxt] == 1:
                raise PartitionError(
                    f"{name} has a cycle through node {graph.node[nxt].name or nxt}; "
                    "an ONNX graph must be acyclic",
                    model=name,
                )
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(deps[nxt]))))
    for i, n in enumerate(graph.node):
        for x in reads[i]:
            if x not in producer and x not in known:
                raise PartitionError(
                    f"node {n.name or i} ({n.op_type}) of {name} reads {x!r}, which no "
                    "node, input or initializer defines; the model is malformed",
                    model=name,
                    node=n.name or str(i),
                    tensor=x,
                )
    return order


def build_graph(
    model: onnx.ModelProto | str | os.PathLike[str],
    *,
    name: str | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
) -> LayerGraph:
    """Group an ONNX model into layers (see [Note: layer grouping]).

    ``input_shapes`` fixes input dims (by input name) and ``inputs`` are sample inputs
    (they fix the shapes too): see `partitioner.shapes`. Shapes that no method knows
    stay unknown (None), never 0.
    """
    samples, inputs = inputs, None  # the local ``inputs`` below are the input names
    if not isinstance(model, onnx.ModelProto):
        path = os.fspath(model)
        model = load_model(path)
        name = name or os.path.splitext(os.path.basename(path))[0]
    name = name or model.graph.name or "model"
    g = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)

    inits = {i.name: i for i in g.initializer}
    inputs = [i.name for i in g.input if i.name not in inits]
    if not inputs:
        raise PartitionError(f"{name} has no inputs besides initializers; nothing to feed it", model=name)
    outputs = [o.name for o in g.output]
    known = set(inits) | {i.name for i in g.input}
    order = _toposort(model, known, name)
    names = node_names(model)
    reads = [node_reads(n) for n in g.node]

    types = _infer(model, name, input_shapes=input_shapes, inputs=samples)
    inferred = types.typed
    batch = types.batch

    def model_shape(t: str) -> tuple[int | str | None, ...] | None:
        """In the terms of partitioner._infer.Dim: the batch as N where it is symbolic."""
        if t in inits:
            return tuple(int(d) for d in inits[t].dims)
        return types.shape.get(t)

    def shape(t: str) -> tuple[int | str, ...] | None:
        """Per-sample sizes where known (N and k*N as 1 and k), for FLOPs and weights."""
        shp = model_shape(t)
        if shp is None:
            return None
        return tuple(d if isinstance(d, int) else (per_sample_factor(d) or (d if isinstance(d, str) else "?"))
                     for d in shp)

    def dtype(t: str) -> str:
        if t in inits:
            return _dtype_name(inits[t].data_type)
        elem = types.elem_type.get(t, 0)
        return _dtype_name(elem) if elem else "unknown"

    # 1. constants (a node with subgraphs only when they too read constants, deterministically)
    const_tensors = set(inits)
    const_nodes: set[int] = set()
    for i in order:
        n = g.node[i]
        if n.op_type in _NONDETERMINISTIC or n.domain not in ("", "ai.onnx"):
            continue
        if any(op in _NONDETERMINISTIC or dom not in ("", "ai.onnx") for dom, op in subgraph_ops(n)):
            continue
        if all(x in const_tensors for x in reads[i]) and not any(x in inputs for x in reads[i]):
            const_nodes.add(i)
            const_tensors.update(o for o in n.output if o)

    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = defaultdict(list)
    for i in order:
        n = g.node[i]
        for o in n.output:
            if o:
                producer[o] = i
        if i in const_nodes:
            continue
        for x in reads[i]:
            if x not in const_tensors and i not in consumers[x]:
                consumers[x].append(i)

    # 2. fusion into layers (node index lists)
    layer_of: dict[int, int] = {}
    members: list[list[int]] = []
    pos = {node: k for k, node in enumerate(order)}
    outset = set(outputs)
    for i in order:
        if i in const_nodes:
            continue
        n = g.node[i]
        target = None
        if n.op_type in FUSABLE_OPS:
            prods = [producer[x] for x in reads[i] if x in producer and x not in const_tensors]
            if prods:
                p = max(prods, key=pos.__getitem__)
                lid = layer_of[p]
                outs_p = [o for o in g.node[p].output if o]
                if members[lid][-1] == p and all(
                    consumers.get(o) == [i] and o not in outset for o in outs_p
                ):
                    target = lid
        if target is None:
            target = len(members)
            members.append([])
        members[target].append(i)
        layer_of[i] = target

    # 3. topological order of layers
    lpreds: list[set[int]] = [set() for _ in members]
    for lid, nodes in enumerate(members):
        for i in nodes:
            for x in reads[i]:
                if x in producer and producer[x] not in const_nodes:
                    q = layer_of[producer[x]]
                    if q != lid:
                        lpreds[lid].add(q)
    new_id = _layer_order(members, lpreds, pos)
    members = [members[old] for old in sorted(range(len(members)), key=new_id.__getitem__)]
    layer_of = {i: new_id[lid] for i, lid in layer_of.items()}

    # tensors that connect layers, or are model inputs/outputs
    crossing: dict[str, tuple[int | None, set[int]]] = {}
    for t in inputs:
        crossing[t] = (None, {layer_of[c] for c in consumers.get(t, [])})
    for i in order:
        if i in const_nodes:
            continue
        lid = layer_of[i]
        for o in g.node[i].output:
            if not o:
                continue
            readers = {layer_of[c] for c in consumers.get(o, [])} - {lid}
            if readers or o in outset:
                crossing[o] = (lid, readers)
    for o in outputs:
        if o not in crossing and o in const_tensors:
            raise PartitionError(
                f"model output {o!r} of {name} is a constant; a constant output cannot be "
                "placed on either side of a cut; remove it from the graph outputs",
                model=name,
                tensor=o,
            )

    tensors = []
    for t, (prod, readers) in crossing.items():
        shp = model_shape(t)
        dt = dtype(t)
        per_sample: tuple[int | str, ...] | None = None
        nbytes: int | None = None
        if shp is not None:
            dims = list(shp)
            if isinstance(batch, int) and dims and dims[0] == batch:
                dims[0] = BATCH
            per_sample = tuple(UNKNOWN_DIM if d is None else d for d in dims)
            factors = [per_sample_factor(d) for d in dims]
            if all(f is not None for f in factors) and _itemsize(dt):
                nbytes = int(np.prod(factors, dtype=np.int64)) * _itemsize(dt)
        tensors.append(
            TensorInfo(
                name=t,
                dtype=dt,
                shape=per_sample,
                bytes_per_sample=nbytes,
                producer=prod,
                consumers=tuple(sorted(readers)),
                is_output=t in outset,
            )
        )
    tensors.sort(key=lambda ti: (-1 if ti.producer is None else ti.producer, ti.name))

    layer_in: dict[int, list[str]] = defaultdict(list)
    layer_out: dict[int, list[str]] = defaultdict(list)
    for ti in tensors:
        if ti.producer is not None:
            layer_out[ti.producer].append(ti.name)
        for c in ti.consumers:
            layer_in[c].append(ti.name)

    def const_closure(nodes: Sequence[int]) -> list[int]:
        need: set[int] = set()
        stack = [producer[x] for i in nodes for x in reads[i] if x in producer and producer[x] in const_nodes]
        while stack:
            j = stack.pop()
            if j in need:
                continue
            need.add(j)
            stack.extend(producer[x] for x in reads[j] if x in producer and producer[x] in const_nodes)
        return sorted(need, key=pos.__getitem__)

    def nbytes_of(t: str) -> int:
        if t in inits:
            init = inits[t]
            return int(np.prod(init.dims, dtype=np.int64)) * _itemsize(_dtype_name(init.data_type))
        shp = shape(t)
        if shp is None or not all(isinstance(d, int) for d in shp):
            return 0
        return int(np.prod(shp, dtype=np.int64)) * _itemsize(dtype(t))

    # Subgraphs carry their own shapes only in the inferred copy of the model.
    inferred_nodes = inferred.graph.node

    def shaped_node(i: int) -> onnx.NodeProto:
        if len(inferred_nodes) == len(g.node) and inferred_nodes[i].op_type == g.node[i].op_type:
            return inferred_nodes[i]
        return g.node[i]

    constant_of = {n.output[0]: n for n in g.node if n.op_type == "Constant" and n.output and n.domain in ("", "ai.onnx")}

    def const_value(t: str) -> np.ndarray | None:
        """The value of an initializer or a Constant node's output (a Loop's trip count)."""
        try:
            if t in inits:
                return numpy_helper.to_array(inits[t])
            if t in constant_of and constant_of[t].attribute:
                v = helper.get_attribute_value(constant_of[t].attribute[0])
                return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)
        except Exception:  # external data not loaded here, or a sparse value
            return None
        return None

    layers = []
    for lid, nodes in enumerate(members):
        params = {x for i in nodes for x in reads[i] if x in const_tensors}
        flops: int | None = 0
        for i in nodes:
            f = node_flops(shaped_node(i), shape, batch, const_value)
            flops = None if f is None or flops is None else flops + f
        layers.append(
            Layer(
                id=lid,
                name=names[nodes[0]],
                nodes=tuple(names[i] for i in nodes),
                ops=tuple(g.node[i].op_type for i in nodes),
                flops=flops,
                param_bytes=sum(nbytes_of(x) for x in params) + sum(subgraph_weight_bytes(g.node[i]) for i in nodes),
                inputs=tuple(layer_in[lid]),
                outputs=tuple(layer_out[lid]),
                const_nodes=tuple(names[j] for j in const_closure(nodes)),
            )
        )
    graph = LayerGraph(
        model=name,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        layers=tuple(layers),
        tensors=tuple(tensors),
        opset=opset,
        ir_version=model.ir_version,
        batch=batch,
        meta={"nodes": len(g.node), "constant_nodes": len(const_nodes)},
    )
    log.debug("built %s: %d nodes -> %d layers", name, len(g.node), len(layers))
    return graph


def _layer_order(members: list[list[int]], lpreds: list[set[int]], pos: dict[int, int]) -> dict[int, int]:
    """Kahn's algorithm over layers, ties broken by the first node's position."""
    import heapq

    indeg = [len(p) for p in lpreds]
    succ: list[list[int]] = [[] for _ in members]
    for lid, ps in enumerate(lpreds):
        for p in ps:
            succ[p].append(lid)
    heap = [(pos[members[lid][0]], lid) for lid in range(len(members)) if indeg[lid] == 0]
    heapq.heapify(heap)
    new_id: dict[int, int] = {}
    while heap:
        _, lid = heapq.heappop(heap)
        new_id[lid] = len(new_id)
        for s in succ[lid]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (pos[members[s][0]], s))
    assert len(new_id) == len(members), "fusion created a cycle between layers"
    return new_id
