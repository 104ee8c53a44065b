"""The ``cloudckpt`` command (face band): ``main`` parses and dispatches and owns the one-line
error surface; each command module takes the command's one ``CommandStorage`` (``store.py``).
Imports anything below it; nothing imports it."""
