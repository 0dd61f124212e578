"""The direct channel between a replica pool and its workers.

Private to ``workers``: the pool (workers.actors) and the worker (workers._worker) use
it; the engine and the edge agent do not. By role:

- ``framing.py``: the one frame format, ``encode_frame``, the refusal frame;
- ``codec.py``: a tensor frame's metadata (a request's or an answer's arrays);
- ``connection.py``: one socket's sending half and its arena handshake;
- ``reader.py``: its reading half, a state machine in the event loop's reader callback;
- ``arena.py``: the shared-memory arenas that large arrays go through on one node;
- ``server.py``: the worker's end; ``client.py``: the pool's end and its link to one
  replica (``DirectLink``).

A request, in order: the pool's ``ChannelClient.call`` -> ``_Connection.send``
(``encode_frame``) -> the worker's ``_Reader._readable`` -> ``ChannelServer._handle``
(answered at once, or by the handler) -> ``ChannelServer._reply`` -> the pool's reader
-> ``ChannelClient._deliver``.

Where each ``[Note: ...]`` of this package is written:

- framing.py: direct channel, no pickle over TCP;
- codec.py: tensor frames, tensor frames' cost;
- reader.py: frames in the reader, reading ahead, no read that would block, frames read
  where they lie;
- server.py: answered at once;
- arena.py: channel arena, arrays made once, inputs kept in the arena.
"""

from workers._transport.client import ChannelClient
from workers._transport.framing import ChannelClosedError, ChannelRefusedError
from workers._transport.server import ChannelServer, open_channel_server

__all__ = ["ChannelClient", "ChannelClosedError", "ChannelRefusedError", "ChannelServer", "open_channel_server"]
