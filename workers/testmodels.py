"""Small models with real weights trained on real data, for accuracy checks.

scikit-learn and skl2onnx are test-time dependencies (the ``test`` extra); they are
imported inside the builders so that importing this module costs nothing.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import onnx

__all__ = ["DIGITS_INPUT_NAME", "DIGITS_OUTPUT_NAME", "make_digits_mlp"]

logger = logging.getLogger(__name__)

DIGITS_INPUT_NAME = "X"
"""Input of the digits MLP: float32[N, 64], pixel intensities scaled to [0, 1]."""

DIGITS_OUTPUT_NAME = "probabilities"
"""Output of the digits MLP: float32[N, 10], class probabilities (softmax)."""

_ONNX_OPSET = 17
# ONNX Runtime refuses IR versions newer than it knows; 8 covers opset 17.
_IR_VERSION = 8


def make_digits_mlp(
    seed: int = 0,
    *,
    hidden_layer_sizes: tuple[int, ...] = (128, 64),
    test_fraction: float = 0.3,
) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """Trains an MLP on scikit-learn's bundled digits (8x8 images, 10 classes; no
    download) and exports it to ONNX with skl2onnx.

    Returns ``(model, X_test, y_test)``: a plain float graph ``X -> MatMul, Add, Relu,
    ..., Softmax -> probabilities`` (zipmap off, label branch removed, so every node is
    one that quantisation handles), and the held-out split it was not trained on, as
    float32[N, 64] in [0, 1] and int64[N]. Deterministic for a given seed; held-out
    accuracy is about 97%. Training takes about a second (BLAS pinned to one thread,
    which is both faster for this size and immune to other processes' load).
    """
    from sklearn.datasets import load_digits
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier
    from skl2onnx import to_onnx
    from threadpoolctl import threadpool_limits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    clf = MLPClassifier(
        hidden_layer_sizes=hidden_layer_sizes,
        max_iter=30,
        learning_rate_init=0.01,
        batch_size=64,
        random_state=seed,
    )
    with threadpool_limits(1), warnings.catch_warnings():
        # 30 epochs reach ~97% held-out accuracy; full convergence adds nothing here.
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(x_train, y_train)
    exported = to_onnx(clf, x_train[:1], options={"zipmap": False}, target_opset=_ONNX_OPSET)
    model = _probabilities_only(exported)
    logger.info("digits MLP seed=%d hidden=%s held-out accuracy=%.4f on %d samples",
                seed, hidden_layer_sizes, clf.score(x_test, y_test), len(y_test))
    return model, x_test, y_test.astype(np.int64)


def _probabilities_only(exported: onnx.ModelProto) -> onnx.ModelProto:
    """Keeps the float path to the probabilities: drops the label branch (ArgMax,
    ArrayFeatureExtractor from ai.onnx.ml), the float->float Cast on the input and
    the Identity on the output."""
    graph = exported.graph
    [inp] = graph.input
    by_output = {o: n for n in graph.node for o in n.output}
    # Walk back from the probabilities output to the input.
    prob_node = by_output[DIGITS_OUTPUT_NAME]
    chain = []
    node = prob_node
    while True:
        chain.append(node)
        data_inputs = [i for i in node.input if i in by_output]
        if not data_inputs:
            break
        node = by_output[data_inputs[0]]
    chain.reverse()
    rename: dict[str, str] = {}
    nodes = []
    for n in chain:
        if n.op_type in ("Cast", "Identity") and len(n.input) == 1:
            rename[n.output[0]] = rename.get(n.input[0], n.input[0])
            continue
        new = onnx.NodeProto()
        new.CopyFrom(n)
        new.ClearField("input")
        new.input.extend(rename.get(i, i) for i in n.input)
        nodes.append(new)
    # The last kept node must produce the graph output under its public name.
    nodes[-1].output[0] = DIGITS_OUTPUT_NAME
    used = {i for n in nodes for i in n.input}
    initializers = [t for t in graph.initializer if t.name in used]
    x = onnx.helper.make_tensor_value_info(
        DIGITS_INPUT_NAME, onnx.TensorProto.FLOAT, [None, 64]
    )
    for n in nodes:
        n.input[:] = [DIGITS_INPUT_NAME if i == inp.name else i for i in n.input]
    n_classes = 10
    y = onnx.helper.make_tensor_value_info(
        DIGITS_OUTPUT_NAME, onnx.TensorProto.FLOAT, [None, n_classes]
    )
    new_graph = onnx.helper.make_graph(nodes, "digits_mlp", [x], [y], initializers)
    model = onnx.helper.make_model(
        new_graph,
        opset_imports=[onnx.helper.make_opsetid("", _ONNX_OPSET)],
        ir_version=_IR_VERSION,
        producer_name="splitinfer.workers.testmodels",
    )
    onnx.checker.check_model(model, full_check=True)
    return model
