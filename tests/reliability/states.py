"""Deterministic 2-rank states for the reliability suite, and how to check what was loaded.

Every tensor's value is a pure function of ``(name, step, gen)``: the test process can build what
any rank saved (and what ``load_full`` must return) without the ranks. ``gen`` tells apart two
saves of the same step (a killed save and its retry, two racing jobs).

Layout of ``rank_state(rank, ...)``:

- ``big.r<rank>``: int32, ``big_bytes`` bytes, held by that rank only: one data object of its own,
  multipart when larger than the store's multipart threshold;
- ``small.<i>``: int32 blocks of ``small_bytes``, replicated on every rank (each is written once,
  the planner spreads them over the ranks): several small data objects per rank;
- ``meta``: ``{"step": step, "gen": gen}`` (a msgpack value).
"""

from __future__ import annotations

import hashlib

import torch

MiB = 1 << 20

SMALL_COUNT = 6


def _seed(*parts) -> int:
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 62) - 1)


def tensor_value(name: str, step: int, gen: int, nbytes: int) -> torch.Tensor:
    """The int32 tensor of ``nbytes`` bytes that ``name`` holds at ``(step, gen)``."""
    g = torch.Generator().manual_seed(_seed(name, step, gen))
    return torch.randint(-(1 << 31), (1 << 31) - 1, (nbytes // 4,), generator=g, dtype=torch.int32)


def rank_state(
    rank: int,
    world: int,
    step: int,
    gen: int,
    *,
    big_bytes: int = 11 * MiB,
    small_bytes: int = 96 << 10,
) -> dict:
    """The state dict rank ``rank`` of a ``world``-rank job saves at ``(step, gen)``."""
    sd = {f"big.r{rank}": tensor_value(f"big.r{rank}", step, gen, big_bytes)}
    for i in range(SMALL_COUNT):
        sd[f"small.{i}"] = tensor_value(f"small.{i}", step, gen, small_bytes)
    sd["meta"] = {"step": step, "gen": gen}
    return sd


def blank_rank_state(
    rank: int, world: int, *, big_bytes: int = 11 * MiB, small_bytes: int = 96 << 10
) -> dict:
    """The same layout as :func:`rank_state`, filled with a sentinel, to load into."""
    sd = {f"big.r{rank}": torch.full((big_bytes // 4,), 0x5A5A5A5A, dtype=torch.int32)}
    for i in range(SMALL_COUNT):
        sd[f"small.{i}"] = torch.full((small_bytes // 4,), 0x5A5A5A5A, dtype=torch.int32)
    sd["meta"] = {"step": -1, "gen": -1}
    return sd


def full_expected(
    world: int, step: int, gen: int, *, big_bytes: int = 11 * MiB, small_bytes: int = 96 << 10
) -> dict:
    """What ``cloudckpt.load_full`` of a ``world``-rank save at ``(step, gen)`` returns."""
    out: dict = {}
    for rank in range(world):
        out[f"big.r{rank}"] = tensor_value(f"big.r{rank}", step, gen, big_bytes)
    for i in range(SMALL_COUNT):
        out[f"small.{i}"] = tensor_value(f"small.{i}", step, gen, small_bytes)
    out["meta"] = {"step": step, "gen": gen}
    return out


def differences(loaded: dict, expected: dict) -> list[str]:
    """Names whose loaded value is not bit-exact (dtype, shape and bytes) or missing/extra."""
    bad = sorted(set(loaded) ^ set(expected))
    for name, want in expected.items():
        if name not in loaded:
            continue
        got = loaded[name]
        if isinstance(want, torch.Tensor):
            if (
                not isinstance(got, torch.Tensor)
                or got.dtype != want.dtype
                or got.shape != want.shape
                or not torch.equal(got, want)
            ):
                bad.append(name)
        elif got != want or type(got) is not type(want):
            bad.append(name)
    return bad
