"""workers._input_check.batch_chunks: the runs both engines split a batch into."""

from workers._input_check import batch_chunks


def test_requests_fill_runs_of_at_most_max_batch_rows_in_order() -> None:
    assert batch_chunks([1, 2, 3, 1, 4], 4) == [(0, 2, 3), (2, 4, 4), (4, 5, 4)]
    assert batch_chunks([], 8) == []


def test_a_request_over_max_batch_runs_alone() -> None:
    assert batch_chunks([2, 9, 1], 4) == [(0, 1, 2), (1, 2, 9), (2, 3, 1)]
