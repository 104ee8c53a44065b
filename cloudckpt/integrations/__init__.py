"""cloudckpt inside the trainers people already use (interop band).

One module per trainer, each importing its framework lazily (the frameworks are optional
extras: ``pip install 'cloudckpt[lightning]'``, ``'cloudckpt[hf]'``): importing
``cloudckpt.integrations`` costs nothing, and a missing framework raises a ``ConfigError`` that
names the extra to install.
"""
