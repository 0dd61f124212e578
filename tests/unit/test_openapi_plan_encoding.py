"""The planner API's OpenAPI document states a plan's encoding as the planner writes it,
lossy codecs included (codec, level, ratio, codec_ms_per_mb), and takes null for an
optional request field, as the service does."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from planner import Encoding
from splitinfer.planner_api import make_openapi


def _draft4(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable`` as JSON Schema draft 4 (whose boolean exclusiveMinimum it shares)."""
    if isinstance(node, dict):
        out = {k: _draft4(v) for k, v in node.items() if k not in ("nullable", "example")}
        if node.get("nullable"):
            out = {"anyOf": [out, {"type": "null"}]}
        return out
    if isinstance(node, list):
        return [_draft4(v) for v in node]
    return node


def _encoding_schema() -> dict[str, Any]:
    return _draft4(make_openapi()["components"]["schemas"]["PlanResponse"]["properties"]["encoding"])


@pytest.mark.parametrize("enc", [Encoding(), Encoding("int8", "zstd", per_channel=True),
                                 Encoding(codec="jpeg", level=90, ratio=0.04, codec_ms_per_mb=3.5),
                                 Encoding(codec="bits", level=4)])
def test_every_encoding_the_planner_writes_keeps_the_schema(enc: Encoding) -> None:
    schema = _encoding_schema()
    d = enc.to_dict()
    jsonschema.Draft4Validator(schema).validate(d)
    assert set(d) <= set(schema["properties"])


def test_the_schema_lists_the_lossy_fields_with_their_types() -> None:
    props = make_openapi()["components"]["schemas"]["PlanResponse"]["properties"]["encoding"]["properties"]
    assert set(props) == set(Encoding(codec="jpeg", level=90, ratio=0.1, codec_ms_per_mb=1.0).to_dict())
    assert (props["codec"]["type"], props["level"]["type"]) == ("string", "integer")
    assert props["ratio"] == props["ratio"] | {"type": "number", "nullable": True}
    assert props["codec_ms_per_mb"] == props["codec_ms_per_mb"] | {"type": "number", "nullable": True}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(_encoding_schema()).validate({**Encoding().to_dict(), "level": "high"})


def test_optional_request_fields_take_null_and_required_ones_do_not() -> None:
    schema = make_openapi()["components"]["schemas"]["PlanRequest"]
    for name, prop in schema["properties"].items():
        assert prop.get("nullable", False) is (name not in schema["required"]), name
