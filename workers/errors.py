"""The workers package's one root exception and its subclasses.

Every error carries keyword-only fields (``model``, ``detail`` and the facts of its
kind) so programs need not parse messages; the message itself names the bad value and
the fix. To add an error (the batcher's, the actors'), subclass :class:`WorkerError`,
call ``super().__init__`` with the message and the root's fields, and list it in
``__all__``.
"""

from __future__ import annotations

__all__ = [
    "BatchingUnsafeError",
    "EngineLoadError",
    "EngineRunError",
    "InputError",
    "RunCancelledError",
    "WorkerError",
]


class WorkerError(Exception):
    """Anything wrong inside a worker: loading or running a segment, batching.

    ``model`` names the model or segment (a path or a label), ``detail`` holds the
    underlying cause in a form fit for a log line (an ONNX Runtime message, say).
    """

    def __init__(self, message: str, *, model: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.model = model
        self.detail = detail


class InputError(WorkerError):
    """A request's tensors do not match what the segment takes.

    ``input_name`` is the offending input (or ``None`` when the set of names is wrong),
    ``expected`` and ``given`` describe it as text (``float32[1,3,224,224]``).
    The engine stays usable after raising it.
    """

    def __init__(
        self,
        message: str,
        *,
        model: str | None = None,
        detail: str | None = None,
        input_name: str | None = None,
        expected: str | None = None,
        given: str | None = None,
    ) -> None:
        super().__init__(message, model=model, detail=detail)
        self.input_name = input_name
        self.expected = expected
        self.given = given


class BatchingUnsafeError(WorkerError):
    """The segment cannot run several requests as one batch.

    ``reason`` says why (a fixed batch dimension that could not be made symbolic, or a
    batch-N run that differed from N batch-1 runs).
    """

    def __init__(
        self,
        message: str,
        *,
        model: str | None = None,
        detail: str | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message, model=model, detail=detail)
        self.reason = reason


class EngineLoadError(WorkerError):
    """A segment could not be prepared, optimised or loaded into ONNX Runtime.

    ``stage`` names the step that failed (``parse``, ``prepare``, ``optimise``,
    ``session``, ``warmup``, ``config``).
    """

    def __init__(
        self,
        message: str,
        *,
        model: str | None = None,
        detail: str | None = None,
        stage: str | None = None,
    ) -> None:
        super().__init__(message, model=model, detail=detail)
        self.stage = stage


class EngineRunError(WorkerError):
    """ONNX Runtime failed while running valid inputs (out of memory, a kernel error).

    ``batch`` is the bucket size of the failed run. Inputs were already validated, so
    this points at the model or the device, not the request.
    """

    def __init__(
        self,
        message: str,
        *,
        model: str | None = None,
        detail: str | None = None,
        batch: int | None = None,
    ) -> None:
        super().__init__(message, model=model, detail=detail)
        self.batch = batch


class RunCancelledError(WorkerError):
    """The run was cancelled (`workers.engine.RunCancel`) before it finished: its caller no
    longer needs the answer. Not a fault of the model, the device or the request."""


# ---------------------------------------------------------------------------------------
# Dynamic batcher (workers/batcher.py) and quantisation (workers/quantize.py) errors.
# Appended as a separate block; the classes above belong to the engine.
# ---------------------------------------------------------------------------------------

__all__ += [
    "BatchSizeMismatchError",
    "BatcherClosedError",
    "BatcherConfigError",
    "BatcherError",
    "BatcherRequestError",
    "CalibrationDataError",
    "DeadlineExceededError",
    "OverloadedError",
    "QueueFullError",
    "QuantizeConfigError",
    "QuantizeError",
    "QuantizeModelError",
]


class BatcherError(WorkerError):
    """Root of the dynamic batcher's errors. ``retryable`` says whether the same
    request may succeed if sent again later."""

    retryable: bool = False


class BatcherConfigError(BatcherError, ValueError):
    """A BatcherConfig field is out of range: ``field_name`` and its ``value``."""

    def __init__(self, message: str, *, field_name: str, value: object, model: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.field_name = field_name
        self.value = value


class BatcherRequestError(BatcherError, ValueError):
    """A submit argument is invalid (priority out of range, unhashable shape_key)."""

    def __init__(self, message: str, *, field_name: str, value: object, model: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.field_name = field_name
        self.value = value


class QueueFullError(BatcherError):
    """``queue_size`` requests wait, the limit is ``max_queue_size``; retry-able."""

    retryable = True

    def __init__(self, message: str, *, queue_size: int, max_queue_size: int,
                 model: str | None = None, detail: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.queue_size = queue_size
        self.max_queue_size = max_queue_size
        self.retry_after_s = retry_after_s
        """The batcher's estimate of when the queue has room again (None: no runs timed yet)."""


class OverloadedError(BatcherError):
    """The request cannot finish before its deadline: refused at once, never run; retry-able.

    ``reason`` is 'predicted_wait' (refused on arrival: the queue ahead of it takes
    longer than its deadline allows) or 'deadline_unreachable' (refused when its batch
    formed: the batch's predicted run time ends after its deadline).
    ``predicted_finish_s`` and ``deadline_s`` are on the batcher's clock;
    ``retry_after_s`` is the estimated time until the queue ahead has drained.
    """

    retryable = True

    def __init__(self, message: str, *, reason: str, predicted_finish_s: float, deadline_s: float,
                 retry_after_s: float, model: str | None = None, detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.reason = reason
        self.predicted_finish_s = predicted_finish_s
        self.deadline_s = deadline_s
        self.retry_after_s = retry_after_s


class DeadlineExceededError(BatcherError):
    """The request's ``deadline_s`` had passed at ``now_s`` before it ran; it never ran."""

    def __init__(self, message: str, *, deadline_s: float, now_s: float,
                 model: str | None = None, detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.deadline_s = deadline_s
        self.now_s = now_s


class BatcherClosedError(BatcherError):
    """The batcher is closed, or was closed with drain=False before the request ran."""

    def __init__(self, message: str, *, pending: int, model: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.pending = pending


class BatchSizeMismatchError(BatcherError):
    """run_batch returned ``num_results`` results for ``batch_size`` payloads."""

    def __init__(self, message: str, *, batch_size: int, num_results: int,
                 model: str | None = None, detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.batch_size = batch_size
        self.num_results = num_results


class QuantizeError(WorkerError):
    """Root of the quantisation errors (workers/quantize.py)."""


class QuantizeConfigError(QuantizeError, ValueError):
    """An option of quantize()/to_fp16() is invalid: ``field_name`` and its ``value``."""

    def __init__(self, message: str, *, field_name: str, value: object, model: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.field_name = field_name
        self.value = value


class QuantizeModelError(QuantizeError):
    """The model could not be read, folded, converted or run. ``stage`` names the step
    (``load``, ``fold``, ``quantize``, ``fp16``, ``evaluate``)."""

    def __init__(self, message: str, *, stage: str, model: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.stage = stage


class CalibrationDataError(QuantizeError, ValueError):
    """The calibration or evaluation data is empty or does not fit the model's inputs.
    ``num_samples`` is how many feeds were seen, ``input_name`` the offending input."""

    def __init__(self, message: str, *, num_samples: int, input_name: str | None = None,
                 model: str | None = None, detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.num_samples = num_samples
        self.input_name = input_name


# ---------------------------------------------------------------------------------------
# Ray actor errors (workers/actors.py, workers/_pool.py, workers/pipeline.py).
# Appended as a separate block; the classes above belong to the engine and the batcher.
# ---------------------------------------------------------------------------------------

__all__ += [
    "ActorConfigError",
    "ReplicaUnavailableError",
    "SegmentNotLoadedError",
]


class ActorConfigError(WorkerError, ValueError):
    """A pool, worker or pipeline setting is invalid: ``field_name`` and its ``value``."""

    def __init__(self, message: str, *, field_name: str, value: object, model: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.field_name = field_name
        self.value = value


class SegmentNotLoadedError(WorkerError):
    """A request named segment ``key``, which this worker has not loaded; ``loaded``
    lists the keys it has."""

    def __init__(self, message: str, *, key: str, loaded: tuple[str, ...] = (), model: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.key = key
        self.loaded = loaded


class ReplicaUnavailableError(WorkerError):
    """The replicas that took the request died or were restarting, ``attempts`` times;
    retry-able: the pool restarts replicas, so the same request may succeed later."""

    retryable = True

    def __init__(self, message: str, *, key: str, attempts: int, model: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.key = key
        self.attempts = attempts
