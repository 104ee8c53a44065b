"""Hugging Face interop: safetensors checkpoints (``cloudckpt.load_safetensors``)."""
