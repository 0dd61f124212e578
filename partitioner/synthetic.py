"""Random layer graphs for property tests and benchmarks.

The graphs look like real models where it matters to cuts: mostly a chain, with skip
connections (tensors read by several layers), branches that join, model inputs read
again by later layers, and sometimes several outputs. Everything is drawn from one
seed, so a failing property test replays exactly.
"""

from __future__ import annotations

import random

from partitioner.graph import BATCH, Layer, LayerGraph, TensorInfo

__all__ = ["make_random_graph", "make_chain_graph"]

_OPS = ("Conv", "Gemm", "MatMul", "Add", "Concat", "MaxPool", "Relu")


def _shape_for(rng: random.Random, max_bytes: int) -> tuple[tuple[int | str, ...], int]:
    channels = rng.choice((1, 3, 8, 16, 32, 64, 128, 256))
    width = max(1, rng.randint(1, max(1, max_bytes // (4 * channels))))
    return (BATCH, channels, width), 4 * channels * width


def make_random_graph(
    n_layers: int,
    *,
    seed: int,
    max_fanin: int = 3,
    p_skip: float = 0.3,
    p_branch: float = 0.3,
    p_input_reuse: float = 0.1,
    with_outputs: int | None = None,
    max_tensor_bytes: int = 1 << 20,
    taper: float = 1.0,
    name: str | None = None,
) -> LayerGraph:
    """A random DAG of ``n_layers`` layers in topological order.

    Layer i reads layer i-1's output, or with probability ``p_branch`` the output of
    a layer 2-4 back (a parallel branch), plus with probability ``p_skip`` up to
    ``max_fanin`` - 1 earlier outputs (joining open branches first, so tensors fan
    out and branches merge), and with probability ``p_input_reuse`` the model input. Each layer writes one tensor; a
    tensor nobody reads is a model output. ``with_outputs`` extra outputs are taken
    from inner tensors (None: 0 or 1 at random). ``taper`` < 1 shrinks the largest
    tensor size geometrically with depth to ``taper`` times the first (as a CNN's
    activations shrink), which makes interior cuts worth taking.
    """
    if n_layers < 1:
        raise ValueError(f"n_layers is {n_layers}; a graph needs at least one layer")
    if max_fanin < 1:
        raise ValueError(f"max_fanin is {max_fanin}; it must be >= 1")
    rng = random.Random(seed)
    in_shape, in_bytes = _shape_for(rng, max_tensor_bytes)
    reads: list[list[str]] = []
    unread: list[int] = []  # branch ends nobody reads yet, joined preferentially
    for i in range(n_layers):
        if i == 0:
            ins = ["input"]
        elif i > 1 and rng.random() < p_branch:
            # a parallel branch off a recent layer, as in Inception blocks
            ins = [f"t{rng.randint(max(0, i - 4), i - 2)}"]
        else:
            ins = [f"t{i - 1}"]
        if i > 1 and max_fanin > 1 and rng.random() < p_skip:
            extra = rng.randint(1, max_fanin - 1)
            for _ in range(extra):
                open_ = [j for j in unread if f"t{j}" not in ins and j < i]
                if open_ and rng.random() < 0.7:
                    j = open_[-1]
                else:
                    # skips are mostly short, as in residual and dense blocks
                    j = max(0, i - 1 - int(rng.expovariate(0.3)) - 1)
                name_j = f"t{j}"
                if name_j not in ins and len(ins) < max_fanin:
                    ins.append(name_j)
        if i > 0 and rng.random() < p_input_reuse and "input" not in ins and len(ins) < max_fanin:
            ins.append("input")
        reads.append(ins)
        read_ids = {int(x[1:]) for x in ins if x != "input"}
        unread = [j for j in unread if j not in read_ids] + [i]
    consumers: dict[str, list[int]] = {"input": []}
    for i in range(n_layers):
        consumers[f"t{i}"] = []
    for i, ins in enumerate(reads):
        for t in ins:
            consumers[t].append(i)
    outputs = [f"t{i}" for i in range(n_layers) if not consumers[f"t{i}"]]
    n_extra = rng.randint(0, 1) if with_outputs is None else with_outputs
    inner = [f"t{i}" for i in range(n_layers) if consumers[f"t{i}"]]
    rng.shuffle(inner)
    outputs += inner[:n_extra]
    outputs.sort(key=lambda s: int(s[1:]))
    out_set = set(outputs)
    tensors = [TensorInfo("input", "float32", in_shape, in_bytes, None, tuple(consumers["input"]), False)]
    layers = []
    for i in range(n_layers):
        tname = f"t{i}"
        if tname in out_set:
            # model outputs are usually small (logits, boxes)
            width = rng.randint(1, 1000)
            shape, nbytes = (BATCH, width), 4 * width
        else:
            cap = max(64, int(max_tensor_bytes * taper ** (i / max(1, n_layers - 1))))
            shape, nbytes = _shape_for(rng, cap)
        tensors.append(TensorInfo(tname, "float32", shape, nbytes, i, tuple(consumers[tname]), tname in out_set))
        op = rng.choice(_OPS)
        layers.append(Layer(
            id=i,
            name=f"{op.lower()}_{i}",
            nodes=(f"{op.lower()}_{i}",),
            ops=(op,),
            flops=int(10 ** rng.uniform(5, 9)),
            param_bytes=int(rng.choice((0, 1, 10, 100, 1000)) * rng.randint(1, 4096)),
            inputs=tuple(reads[i]),
            outputs=(tname,),
        ))
    return LayerGraph(
        model=name or f"random{n_layers}_s{seed}",
        inputs=("input",),
        outputs=tuple(outputs),
        layers=tuple(layers),
        tensors=tuple(tensors),
        opset=17,
        ir_version=8,
        meta={"synthetic": True, "seed": seed},
    )


def make_chain_graph(n_layers: int, *, seed: int, max_tensor_bytes: int = 1 << 20) -> LayerGraph:
    """A random chain: each layer reads only the previous one (Neurosurgeon's case)."""
    return make_random_graph(n_layers, seed=seed, max_fanin=1, p_skip=0.0, p_branch=0.0, p_input_reuse=0.0,
                             with_outputs=0, max_tensor_bytes=max_tensor_bytes,
                             name=f"chain{n_layers}_s{seed}")
