"""Pure planning: piece descriptors, save plans (local, global, cached), load plans and the
read-once-broadcast assignment, with msgpack codecs. No I/O, no torch, no collectives."""
