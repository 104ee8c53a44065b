"""Read-once broadcasts of a load, pure: which rank reads a region several ranks need
(``readers``), which groups run (``groups``), regions cut for the wire (``parts``), sources,
batches and rounds (``rounds``), and the frozen
``BroadcastPlan`` the data plane moves (``plan``)."""
