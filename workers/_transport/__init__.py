"""The direct channel between a replica pool and its workers: framing and the socket,
the shared-memory arena, the codec of arrays and answers, the worker's end and the
pool's end (see [Note: direct channel] in workers/_transport/connection.py).

Private to ``workers``: the pool (workers.actors) and the worker (workers._worker) use
it; the engine and the edge agent do not.
"""
