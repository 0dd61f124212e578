"""Module-scoped fixtures shared by the Ray worker tests: a local Ray started for the
module, an engine config with one shared artefact cache, a SqueezeNet tail after layer
28 and a plain single-thread ONNX Runtime session of it as the reference."""

from __future__ import annotations

import onnxruntime as ort
import pytest

import partitioner
from workers.engine import EngineConfig


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    kwargs = dict(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
                  configure_logging=False)
    try:
        ray.init(**kwargs)
    except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
        # Seen on the 2-core machine: the raylet never started (no log of its own) and
        # ray.init gave up after 30 s, or the GCS never wrote its port file ("Timed out
        # waiting for file .../gcs_server_port_..."). A second start is a fresh session.
        if "timed out during startup" not in str(e) and "Timed out waiting for file" not in str(e):
            raise
        ray.shutdown()
        ray.init(**kwargs)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory):
    # A shared artefact cache: replicas (and restarted replicas) load without rebuilding.
    return EngineConfig(intra_op_threads=1, cache_dir=str(tmp_path_factory.mktemp("artefacts")))


@pytest.fixture(scope="module")
def tail():
    model = partitioner.load_zoo("squeezenet", random_weights=True)
    graph = partitioner.build_graph(model)
    _, t = partitioner.split(model, partitioner.prefix_cut(graph, 28), graph=graph)
    return t.model


@pytest.fixture(scope="module")
def reference(tail):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(tail.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return lambda inputs: dict(zip(names, sess.run(None, inputs)))
