"""Multi-rank process worlds for tests: world (ProcessWorld, owner side), zygote, worker."""
