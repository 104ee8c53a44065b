"""Hugging Face interoperability: safetensors headers (``header``, pure), planning an export's
files (``shards``, pure), where an export writes (``destinations``), the export itself
(``export``: :func:`cloudckpt.export_safetensors`), and loading a safetensors checkpoint into any
state dict (``load``: :func:`cloudckpt.load_safetensors`)."""
