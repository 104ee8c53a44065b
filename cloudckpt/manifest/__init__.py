"""The checkpoint manifest: data model, msgpack codec, validation of untrusted bytes, and the
exact-type encoding of non-tensor values. Pure: no I/O, no torch, no collectives."""
