"""One request's life as a small state machine: exactly one answer, never two, never none.

    NEW --local--> LOCAL --local_done--> ANSWERED
    NEW --offload--> HEAD --head_done--> REMOTE --remote_ok--> ANSWERED
    HEAD --head_error--> LOCAL                  (the whole model, from the input)
    HEAD --encode_error--> LOCAL_TAIL           (the cut's tail, from the head output)
    REMOTE --remote_error | remote_timeout | remote_cancelled--> LOCAL_TAIL  (fallback 'local')
                                                              --> FAILED      (fallback 'none')
    LOCAL_TAIL --local_done--> ANSWERED;  LOCAL_TAIL --remote_ok--> ANSWERED (a slow answer that
                                          beat the local tail still wins; the tail is dropped)
    LOCAL | LOCAL_TAIL --local_error--> FAILED   (the error is the answer)
    ANSWERED | FAILED --anything--> unchanged, and the late result is counted as dropped

`fire` says whether the event delivered the answer; only one event per flow ever does.
Pure: no I/O, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestFlow", "Step", "TRANSITIONS", "STATES", "EVENTS", "FlowError"]

NEW, HEAD, REMOTE, LOCAL, LOCAL_TAIL, ANSWERED, FAILED = (
    "new", "head", "remote", "local", "local_tail", "answered", "failed")
STATES = (NEW, HEAD, REMOTE, LOCAL, LOCAL_TAIL, ANSWERED, FAILED)
EVENTS = ("local", "offload", "head_done", "head_error", "encode_error", "remote_ok", "remote_error",
          "remote_timeout", "remote_cancelled", "local_done", "local_error")
_REMOTE_FAIL = ("remote_error", "remote_timeout", "remote_cancelled")

# (state, event) -> (next state, delivers the answer). Fallback-dependent rows are in `fire`.
TRANSITIONS: dict[tuple[str, str], tuple[str, bool]] = {
    (NEW, "local"): (LOCAL, False),
    (NEW, "offload"): (HEAD, False),
    (HEAD, "head_done"): (REMOTE, False),
    (HEAD, "head_error"): (LOCAL, False),
    (HEAD, "encode_error"): (LOCAL_TAIL, False),
    (REMOTE, "remote_ok"): (ANSWERED, True),
    **{(REMOTE, e): (LOCAL_TAIL, False) for e in _REMOTE_FAIL},
    (LOCAL, "local_done"): (ANSWERED, True),
    (LOCAL, "local_error"): (FAILED, True),
    (LOCAL_TAIL, "local_done"): (ANSWERED, True),
    (LOCAL_TAIL, "local_error"): (FAILED, True),
    (LOCAL_TAIL, "remote_ok"): (ANSWERED, True),
    **{(LOCAL_TAIL, e): (LOCAL_TAIL, False) for e in _REMOTE_FAIL},
}


class FlowError(RuntimeError):
    """An event that cannot happen in this state: a bug in the request path, never input."""


@dataclass(frozen=True)
class Step:
    state: str
    """State after the event."""
    delivers: bool
    """This event's result is the answer."""
    late: bool
    """The event came after the answer and its result is dropped."""


class RequestFlow:
    """The state of one request; `fire(event)` moves it."""

    def __init__(self, request_id: str, *, fallback_local: bool = True) -> None:
        self.request_id = request_id
        self.fallback_local = fallback_local
        self.state = NEW
        self.answered_by = ""
        self.history: list[str] = []

    @property
    def done(self) -> bool:
        return self.state in (ANSWERED, FAILED)

    def fire(self, event: str) -> Step:
        if event not in EVENTS:
            raise FlowError(f"unknown event {event!r}; events are {EVENTS}")
        self.history.append(event)
        if self.done:
            return Step(self.state, False, True)
        if self.state == REMOTE and event in _REMOTE_FAIL and not self.fallback_local:
            nxt, delivers = FAILED, True
        else:
            row = TRANSITIONS.get((self.state, event))
            if row is None:
                raise FlowError(f"request {self.request_id}: event {event!r} cannot happen in state {self.state!r}")
            nxt, delivers = row
        self.state = nxt
        if delivers:
            self.answered_by = event
        return Step(nxt, delivers, False)
