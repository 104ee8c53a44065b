"""The node-local checkpoint tier of a run: recent checkpoints on each node, replicated to peers,
with the run's object store behind them (``CheckpointManager(..., local=LocalTier(...))``).

- :mod:`cloudckpt.runs.tier.options`: ``LocalTier``, the option.
- :mod:`cloudckpt.runs.tier.node`: one node's tier directory: its marker (job, format), what it
  holds (the inventory, also as untrusted bytes from a peer), keep rules.
- :mod:`cloudckpt.runs.tier.peers`: this process's service of its node's tier, the job's nodes
  and who replicates to whom.
- :mod:`cloudckpt.runs.tier.flow`: the manager's save, load and listing with a tier.
"""
