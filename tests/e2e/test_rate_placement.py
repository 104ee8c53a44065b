"""Replicated bytes follow the ranks' write rates (planning/save/rates.py): a rank told it writes
at a quarter of the others' rate writes about a quarter of their share, and what was saved reads
back exactly; a save measures the rate. Real gloo world of 3 against SeaweedFS."""

from __future__ import annotations

import torch

import cloudckpt
from cloudckpt.planning.save import rates, replicas

PIECE = 64 << 10


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(27)
    return {f"w{i}": torch.randn(1024, 256, generator=g) for i in range(2)} | {  # 1 MiB each
        "step": torch.tensor(3)
    }


def rank_save(url: str, told: list[float]) -> tuple[int, float]:
    import torch.distributed as dist

    saved = replicas.REPLICA_PIECE_BYTES, rates.MIN_SAMPLE_BYTES
    replicas.REPLICA_PIECE_BYTES = PIECE
    rates.WRITE_RATES.forget()
    try:
        rates.WRITE_RATES.tell(told[dist.get_rank()])
        options = cloudckpt.SaveOptions(use_plan_cache=False)
        written = cloudckpt.save(_state(), url, options=options).rank_bytes_written
        rates.WRITE_RATES.forget()  # measured from here on
        rates.MIN_SAMPLE_BYTES = 1
        cloudckpt.save(_state(), f"{url}-measured", options=options)
        return written, rates.WRITE_RATES.rate
    finally:
        replicas.REPLICA_PIECE_BYTES, rates.MIN_SAMPLE_BYTES = saved
        rates.WRITE_RATES.forget()


def test_slow_rank_writes_its_rate_share(world3, s3_url, s3_env):
    out = world3.run(rank_save, s3_url, [40e6, 40e6, 10e6])
    written = [w for w, _ in out]
    state = _state()
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert sum(written) == total
    # shares 4/9, 4/9, 1/9 (an even spread gives each a third)
    assert written[2] <= total / 9 + PIECE and min(written[:2]) >= 4 * total / 9 - PIECE, written
    full = cloudckpt.load_full(s3_url)
    assert all(torch.equal(full[k], t) for k, t in state.items())
    assert all(rate > 0 for _, rate in out)  # every rank measured its upload
    assert cloudckpt.verify(f"{s3_url}-measured").ok
