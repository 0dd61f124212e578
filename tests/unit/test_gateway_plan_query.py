"""Reading a Plan query's gateway fields (no network, no planner run)."""

from __future__ import annotations

import pytest

from cluster._plan import QUERY_FIELDS, PlanQuery, read_query
from cluster.errors import InvalidArgument


def test_gateway_fields_are_split_from_the_planner_body():
    q = read_query({"model": "m", "version": "2", "device_id": "d7", "frontier": False,
                    "edge": "rpi4", "uplink": 1e6, "slo": 50})
    assert (q.model, q.version, q.device_id, q.with_frontier) == ("m", "2", "d7", False)
    assert q.body == {"edge": "rpi4", "uplink": 1e6, "slo": 50}
    assert PlanQuery.from_dict(q.to_dict()) == q


def test_defaults_route_the_version_and_ask_for_the_frontier():
    q = read_query({"model": "m", "edge": "rpi4", "uplink": 1e6})
    assert (q.version, q.device_id, q.with_frontier) == ("", "", True)


@pytest.mark.parametrize("query, field, needle", [
    ([1], "query", "send a map"),
    ({"edge": "rpi4"}, "model", "missing"),
    ({"model": ""}, "model", "empty"),
    ({"model": 3}, "model", "must be a string"),
    ({"model": "m", "version": 2}, "version", "must be a string"),
    ({"model": "m", "frontier": 1}, "frontier", "true or false"),
    ({"model": "m", "cloud": "t4"}, "cloud", "own cloud profile"),
    ({"model": "m", "uplnk": 5}, "uplnk", "check the spelling"),
])
def test_bad_queries_name_the_field(query, field, needle):
    with pytest.raises(InvalidArgument, match=needle) as e:
        read_query(query)
    assert e.value.field == field
    assert "cloud" not in QUERY_FIELDS
