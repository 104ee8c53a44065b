"""A node's local checkpoint tier served to the other nodes of the job, and read back.

- :mod:`cloudckpt.storage.peer.server`: ``PeerServer``, a small HTTP service (aiohttp) over one
  directory: GET (whole or one byte range), HEAD, PUT in create mode; every request carries the
  job's token.
- :mod:`cloudckpt.storage.peer.client`: ``PeerStore``, the read/put subset of an ``ObjectStore``
  on another node's service; every answer is untrusted (bounded, checked, crc-verified reads).
- :mod:`cloudckpt.storage.peer.tiered`: ``TieredStore``, an object read from the first of its
  holders (this node, peers, the object store) whose bytes verify.
"""
