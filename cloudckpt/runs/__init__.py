"""A run of checkpoints (control band): ``CheckpointManager`` (``manager``: thin, composes the
rest), the keep rules (``retention``, pure), listing and pruning (``pruning``), deletion plans and
carrying them out (``cleanup``), pins and references (``refs``), preemption and spot notices.
Saves and loads go through ``api/``; one ``ControlChannel.phase`` per decision of its own."""
