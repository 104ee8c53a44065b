"""``LocalTier``: the option of a run's node-local checkpoint tier."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LocalTier:
    """Keep recent checkpoints on each node, replicated to other nodes, with the run's object
    store behind them (docs/guide.md, "Fast recovery").

    - ``path``: this node's tier directory (``/dev/shm/...`` or a local NVMe path). It must
      outlive the training processes, and each node has its own (ranks of one node pass the
      same path; two nodes never share one).
    - ``replicas``: how many other nodes receive a copy of this node's objects (0: none).
    - ``every``: a save of step ``s`` goes to the tier when ``s % every == 0`` (other steps go
      to the object store only).
    - ``store_every``: a tier save of step ``s`` is also written to the object store when
      ``s % store_every == 0``, by copying the tier's checkpoint (same manifest, same objects).
    - ``background``: that copy runs on a background thread (``True``) or before ``save``
      returns (``False``).
    - ``keep``: steps each node's tier keeps (newest first); a step whose copy to the object
      store has not committed yet is kept whatever ``keep`` says.
    - ``max_bytes``: the most a node's tier may hold (``None``: what the disk has); a save that
      would not fit goes to the object store only, with a warning.
    - ``job``: the tier's owner (default: the run's URL); a tier directory written by another
      job, or by another format version, is ignored with a warning.
    - ``host``: the address other nodes reach this node's tier service at (default: the address
      this node uses to reach the rendezvous, ``MASTER_ADDR``, or ``127.0.0.1``).
    """

    path: str
    replicas: int = 1
    every: int = 1
    store_every: int = 1
    background: bool = True
    keep: int = 2
    max_bytes: int | None = None
    job: str | None = None
    host: str | None = None
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("LocalTier(path=...) needs this node's tier directory")
        for name in ("every", "store_every", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LocalTier({name}=...) must be an int >= 1, got {value!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise ValueError(f"LocalTier(replicas=...) must be an int, got {self.replicas!r}")
        if self.replicas < 0:
            raise ValueError(f"LocalTier(replicas=...) must be >= 0, got {self.replicas}")
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError(f"LocalTier(max_bytes=...) must be >= 0, got {self.max_bytes}")
