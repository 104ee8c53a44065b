"""The data plane: every module that moves checkpoint bytes (see docs/architecture.md).

- :mod:`~cloudckpt.dataplane.buffers`: byte views of tensors, pooled buffers;
- :mod:`~cloudckpt.dataplane.writer`: packing a rank's items into data objects, crcs, uploads;
- :mod:`~cloudckpt.dataplane.reader`: regions -> crc-verified ranged reads, through verified
  sinks or windows in pooled buffers;
- :mod:`~cloudckpt.dataplane.destinations`: a load's destination tensors, reading read items
  into them;
- :mod:`~cloudckpt.dataplane.broadcast`: this rank's bytes in the read-once broadcasts.

Nothing here runs a collective or knows the save/load protocol: :mod:`cloudckpt.api` sequences
the phases and the collectives and calls into this package for the bytes.
"""
