"""The planning phases of the save protocol (:mod:`cloudckpt.api.save`, phases 1-2): a rank's
local plan from its state dict, and its share of the global plan, which the coordinator alone
computes when the plan cache cannot serve every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cloudckpt.api.reports import SavePlanReport, SaveShares
from cloudckpt.manifest.values import encode_value
from cloudckpt.options import SaveOptions
from cloudckpt.planning.save.global_plan import plan_global_save
from cloudckpt.planning.save.local_plan import LocalSavePlan, encode_local_save_plan
from cloudckpt.planning.save.rates import RateWeights
from cloudckpt.planning.save.share import SaveShare, decode_share, encode_shares
from cloudckpt.runtime.hugepages import without_huge_page_advice
from cloudckpt.statedict.flatten import flatten_state_dict
from cloudckpt.statedict.stateful import resolve_stateful
from cloudckpt.transport import ControlChannel


@dataclass(frozen=True)
class LocalSave:
    """What phase 1 leaves on this rank: its local plan, the tensor of each planned piece, its
    encoded values and its nesting."""

    plan: LocalSavePlan
    tensors: list
    values: dict[str, bytes]
    structure: Any


def plan_locally(state_dict, channel: ControlChannel, allow_pickle: bool) -> LocalSave:
    """``state_dict()`` on stateful values, flatten, this rank's local plan."""
    resolved, _ = resolve_stateful(state_dict)
    flat = flatten_state_dict(resolved)
    pieces, tensors = [], []
    for leaf in flat.tensors.values():
        for spec, tensor in leaf.pieces:
            pieces.append(spec)
            tensors.append(tensor)
    values = {
        name: encode_value(v.value, key=name, allow_pickle=allow_pickle)
        for name, v in flat.values.items()
    }
    plan = LocalSavePlan(
        rank=channel.rank,
        world_size=channel.size,
        pieces=tuple(pieces),
        value_names=tuple(flat.values),
    )
    return LocalSave(plan=plan, tensors=tensors, values=values, structure=flat.structure)


def chunk_view(tensor, within: tuple[int, ...], sizes: tuple[int, ...]):
    """The box of a local piece a write item covers, from ``within`` (a view; the piece itself
    when the item is the whole piece: a row range of a replicated piece otherwise). The dims
    past the piece's ndim (padding: 0 and 1) are ignored."""
    for d in range(tensor.dim()):
        if within[d] or sizes[d] != tensor.shape[d]:
            tensor = tensor.narrow(d, within[d], sizes[d])
    return tensor


def plan_globally(
    channel: ControlChannel,
    local: LocalSavePlan,
    width: int,
    options: SaveOptions,
    weights: RateWeights,
) -> SaveShare:
    """Phase 2 without a cached plan: the local plans gathered to the coordinator (``width``:
    the longest one's length, from the planning phase's reports), which alone plans the save
    and cuts every rank's share; the shares scattered; each rank decodes and checks its own.
    Two phases (``save global planning``, ``save plan share``): a failure of either on any
    rank raises the same error on every rank. The coordinator plans without numpy's huge-page
    advice (``runtime.hugepages``)."""
    plans = channel.gather_bytes(encode_local_save_plan(local), width=width)
    shares: list[bytes] | None = None
    skeleton = None
    with channel.phase("save global planning", SaveShares) as planning:
        if channel.is_coordinator:
            with without_huge_page_advice():  # fresh large arrays, used once
                plan = plan_global_save(
                    [SavePlanReport.decode(raw).plan for raw in plans],
                    rank=0,
                    replicas_to_lowest_rank=options.replicas_to_lowest_rank,
                    rate_weights=weights,
                )
                shares, skeleton = encode_shares(plan), plan.skeleton
            planning.report = SaveShares(width=max(len(s) for s in shares))
    mine = channel.scatter_bytes(shares, width=planning.reports[0].width)
    with channel.phase("save plan share"):
        share = decode_share(mine, local, skeleton)
    return share
