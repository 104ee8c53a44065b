"""The public save/load API: the only place that sequences collectives.

Import the functions from :mod:`cloudckpt` (``cloudckpt.save``, ``cloudckpt.load``, ...); the
modules here are ``save`` (the save protocol), ``load`` (load, load_full, read_manifest),
``async_save`` (background saves) and ``verify`` (checksum verification of a whole checkpoint).
"""
