"""Hugging Face interoperability: safetensors headers (``header``, pure), planning an export's
files (``shards``, pure), where an export writes (``destinations``) and the export itself
(``export``: :func:`cloudckpt.export_safetensors`)."""
