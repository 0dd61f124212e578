"""How load failures are classified and reported: the metric's reason for each error, which
errors may pass, the health of each model, and what a request for a model that is loading
or failed gets from the registry."""

from __future__ import annotations

import onnx
import pytest

from cluster._load_failures import NoTailLoaded, is_transient, load_failure_reason, one_line, service_health
from cluster.errors import FailedPrecondition, Unavailable, UnknownModelError
from cluster.metrics import LOAD_FAILURE_REASONS, GatewayMetrics
from cluster.registry import Registry, RegistryError
from tests.onnx_models import conv_bn_relu_chain
from workers.errors import EngineLoadError


@pytest.mark.parametrize("error, cutting, reason", [
    (EngineLoadError("x", stage="optimise"), False, "optimise"),
    (EngineLoadError("x", stage="warmup"), False, "warmup"),
    (EngineLoadError("x", stage="session"), False, "session"),
    (EngineLoadError("x", stage="parse"), False, "session"),
    (RegistryError(path="p", reason="r", fix="f"), False, "registry"),
    (RegistryError(path="p", reason="r", fix="f"), True, "cut"),
    (ValueError("x"), False, "other"),
])
def test_each_error_has_a_reason_from_the_fixed_set(error, cutting, reason):
    assert load_failure_reason(error, cutting=cutting) == reason and reason in LOAD_FAILURE_REASONS


def test_only_errors_that_may_pass_are_transient():
    assert is_transient(Unavailable(reason="workers not placed"))
    assert not is_transient(FailedPrecondition(reason="r", fix="f"))
    assert not is_transient(NoTailLoaded(reason="r", fix="f"))
    assert not is_transient(EngineLoadError("x", stage="session"))


def test_one_line_keeps_the_first_line():
    assert one_line(ValueError("first\nsecond")) == "first" and one_line(ValueError("")) == "ValueError"


def test_service_health_marks_failed_models_and_tails_not_serving():
    detail = {"versions": ["a@1", "b@2"], "failed": {"b@1": "failed: x", "a@1@L": "y", "c@1": "failed: z"}}
    assert service_health(detail) == {"a@1": True, "a": True, "b@2": True, "b": True, "b@1": False,
                                      "a@1@L": False, "c@1": False, "c": False}


def test_an_unknown_reason_is_counted_as_other():
    metrics = GatewayMetrics()
    metrics.observe_load_failure("m", "1", "no-such-reason")
    assert metrics.load_failures.labels("m", "1", "other")._value.get() == 1.0


def test_a_request_for_a_model_that_loads_gets_unavailable_and_one_that_failed_the_cause(tmp_path):
    for name in ("m", "broken"):
        (tmp_path / name / "1").mkdir(parents=True)
        onnx.save(conv_bn_relu_chain(1), str(tmp_path / name / "1" / "model.onnx"))
    (tmp_path / "broken" / "1" / "model.yaml").write_text("max_batch_size: 0\n")
    registry = Registry(str(tmp_path))
    seen = []

    def during_load(lv):
        with pytest.raises(Unavailable) as e:
            registry.resolve("m", "")
        seen.append(str(e.value))

    registry.on_loaded.append(during_load)
    failures = []
    registry.on_failed.append(lambda model, version, e: failures.append((model, version, type(e).__name__)))
    registry.load_all(keep_going=True)
    assert seen == ["unavailable: m@1 is loading; retry once GET /readyz lists it among the versions; retry with "
                    "backoff or run locally"]
    assert failures == [("broken", "1", "RegistryError")]
    for version in ("1", ""):
        with pytest.raises(FailedPrecondition) as e:
            registry.resolve("broken", version)
        assert "broken@1 is not served: failed: " in str(e.value) and "max_batch_size=0" in str(e.value)
    with pytest.raises(UnknownModelError):
        registry.resolve("nosuch", "")
