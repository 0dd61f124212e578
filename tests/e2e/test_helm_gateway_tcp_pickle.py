"""gateway.directTcpPickle in the Helm chart: rendered as --direct-tcp-pickle only when true,
and the gateway's parser turns the rendered flag into the Ray pools' setting.

Rendering is real Helm through helm-python-sdk, offline (see test_helm_chart.py)."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from splitinfer.gateway_cmd import make_parser, ray_pool_factory
from tests.e2e.test_helm_workloads import CHART_DIR, FULLNAME, KUBE_VERSION, NAMESPACE, RELEASE

pytestmark = pytest.mark.helm


def _gateway_deployment(values: dict[str, Any] | None) -> dict[str, Any]:
    with helm.Chart.load(CHART_DIR) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    (gateway,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{FULLNAME}-gateway"]
    return gateway


def _args(deployment: dict[str, Any]) -> list[str]:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    return container["args"]


def test_direct_tcp_pickle_true_renders_the_flag_the_gateway_takes() -> None:
    gateway = _gateway_deployment({"gateway": {"directTcpPickle": True}})
    kubernetes_validate.validate(gateway, KUBE_VERSION, strict=True)
    args = _args(gateway)
    assert args.count("--direct-tcp-pickle") == 1
    assert ray_pool_factory(make_parser().parse_args(args[1:])).tcp_pickle is True


@pytest.mark.parametrize("values", [None, {"gateway": {"directTcpPickle": False}}])
def test_direct_tcp_pickle_is_absent_by_default_and_when_false(values: dict[str, Any] | None) -> None:
    args = _args(_gateway_deployment(values))
    assert "--direct-tcp-pickle" not in args
    assert ray_pool_factory(make_parser().parse_args(args[1:])).tcp_pickle is False


def test_the_schema_refuses_a_non_boolean() -> None:
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(Exception, match="directTcpPickle"):
        chart.render({"gateway": {"directTcpPickle": "yes"}}, name=RELEASE, namespace=NAMESPACE)
