"""State dicts as people write them, end to end: every container kind saves and loads (world 1
on a local path through every entry point, world 2 over S3), and stateful objects whose
``state_dict`` / ``load_state_dict`` run collectives are called in one order on every rank, even
when each rank built its dicts in a different key order.
"""

from __future__ import annotations

from types import MappingProxyType

import pytest
import torch
import torch.distributed as dist

import cloudckpt
from cloudckpt.cli.main import main as cli_main
from cloudckpt.errors import PlanningError
from tests.planning.containers import (
    check_loaded_in_place,
    expected,
    people_state,
    problems,
    structure_containers,
)


def _load_and_check(url: str, salt: int = 0, load=None) -> list[str]:
    blank = people_state(blank=True)
    before = structure_containers(blank)
    (load or cloudckpt.load)(blank, url)
    return check_loaded_in_place(blank, before, salt=salt)


# -- world 1, local path: save / async_save / manager; load / load_full / CLI export ---------


def test_containers_save_and_load_on_a_local_path_through_every_entry_point(tmp_path):
    url = str(tmp_path / "ckpt")
    cloudckpt.save(people_state(), url)
    assert _load_and_check(url) == []
    full = cloudckpt.load_full(url)
    assert problems(full, expected(people_state(), keep_types=False)) == []

    handle = cloudckpt.async_save(people_state(salt=1), str(tmp_path / "async"))
    handle.result()
    assert _load_and_check(str(tmp_path / "async"), salt=1) == []

    mgr = cloudckpt.CheckpointManager(str(tmp_path / "run"))
    mgr.save(5, people_state(salt=2))
    mgr.save(6, people_state(salt=3), blocking=False)
    mgr.wait()
    assert _load_and_check("", salt=3, load=lambda sd, _: mgr.load(sd)) == []
    assert _load_and_check("", salt=2, load=lambda sd, _: mgr.load(sd, step=5)) == []

    out = tmp_path / "export.pt"
    assert cli_main(["export", url, str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    assert problems(exported, expected(people_state(), keep_types=False)) == []
    assert cli_main(["verify", url]) == 0


def test_a_value_in_a_read_only_mapping_is_refused_before_any_data_moves(tmp_path):
    url = str(tmp_path / "ckpt")
    cloudckpt.save({"ro": MappingProxyType({"w": torch.ones(2), "n": 5})}, url)
    assert (
        problems(
            cloudckpt.load_full(url),
            expected({"ro": {"w": torch.ones(2), "n": 5}}, keep_types=False),
        )
        == []
    )
    blank = {"ro": MappingProxyType({"w": torch.zeros(2), "n": 0})}
    with pytest.raises(PlanningError, match="value 'ro.n' sits in a read-only mappingproxy"):
        cloudckpt.load(blank, url)
    assert torch.equal(blank["ro"]["w"], torch.zeros(2))
    only_tensors = {"ro": MappingProxyType({"w": torch.zeros(2)})}
    cloudckpt.load(only_tensors, url, strict=False)  # tensors inside are filled in place
    assert torch.equal(only_tensors["ro"]["w"], torch.ones(2))


# -- world 2 over S3 ----------------------------------------------------------------------------


def rank_containers(url: str, action: str) -> list[str]:
    if action == "save":  # both ranks hold it: replicated, written once
        cloudckpt.save(people_state(), url)
        return []
    return _load_and_check(url)


def test_containers_save_and_load_on_two_ranks_over_s3(world2, s3_url, s3_env):
    assert world2.run(rank_containers, s3_url, "save") == [[], []]
    assert world2.run(rank_containers, s3_url, "load") == [[], []]
    full = cloudckpt.load_full(s3_url)
    assert problems(full, expected(people_state(), keep_types=False)) == []


# -- stateful objects that run collectives ------------------------------------------------------


class Collective:
    """A stateful object whose ``state_dict`` and ``load_state_dict`` run collectives (as FSDP's
    do): every rank must be in the same object at the same time. Each call gathers the object's
    name from every rank and all-reduces its id, and logs both."""

    def __init__(self, name: str, log: list, inner=None):
        self.name, self.log, self.inner = name, log, inner
        self.weight = torch.full((2,), float(len(name)))
        self.loaded = None

    def _agree(self, what: str) -> None:
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, self.name)
        ident = torch.tensor([sum(map(ord, self.name))], dtype=torch.int64)
        total = ident.clone()
        dist.all_reduce(total)
        self.log.append((what, names, int(total) == int(ident) * dist.get_world_size()))

    def state_dict(self):
        self._agree("state_dict")
        return {"weight": self.weight, "name": self.name, **(self.inner or {})}

    def load_state_dict(self, sd):
        self._agree("load_state_dict")
        self.loaded = (sd["name"], sd["weight"].clone())


def collective_state(log: list, reverse: bool) -> dict:
    """Stateful objects at int and str keys, nested in dicts and lists and inside each other;
    every dict built in reverse key order when ``reverse``."""

    def d(*items):
        return dict(reversed(items) if reverse else items)

    inner = d(("y", Collective("list.0.y", log)), ("x", Collective("list.0.x", log)))
    return d(
        ("b", Collective("b", log)),
        ("a", Collective("a", log)),
        (10, Collective("10", log)),
        (2, Collective("2", log)),
        ("nested", d(("z", Collective("nested.z", log)), ("c", Collective("nested.c", log)))),
        ("list", [Collective("list.0", log, inner), Collective("list.1", log)]),
        ("step", 7),
    )


SAVE_ORDER = [
    "2",
    "10",
    "a",
    "b",
    "list.0",
    "list.0.x",
    "list.0.y",
    "list.1",
    "nested.c",
    "nested.z",
]
LOAD_ORDER = [
    "2",
    "10",
    "a",
    "b",
    "list.0.x",
    "list.0.y",
    "list.0",
    "list.1",
    "nested.c",
    "nested.z",
]


def rank_collective_stateful(url: str, action: str) -> list:
    """Save or load, each rank building its dicts in its own key order; returns the calls
    ``[(method, names gathered from every rank, ids agreed)]`` and what each object loaded."""
    log: list = []
    sd = collective_state(log, reverse=dist.get_rank() == 1)
    if action == "save":
        cloudckpt.save(sd, url)
        return [log, []]
    for obj in _collectives(sd):
        obj.weight = torch.zeros(2)
    cloudckpt.load(sd, url)
    loaded = sorted((obj.name, obj.loaded[0], obj.loaded[1].tolist()) for obj in _collectives(sd))
    return [log, loaded]


def _collectives(tree) -> list:
    out = []
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else ()
    for v in items:
        if isinstance(v, Collective):
            out.append(v)
            out += _collectives(v.inner or {})
        else:
            out += _collectives(v)
    return out


def test_stateful_collectives_run_in_one_order_whatever_each_rank_built(world2, s3_url):
    saved = world2.run(rank_collective_stateful, s3_url, "save", timeout=60)
    loaded = world2.run(rank_collective_stateful, s3_url, "load", timeout=60)
    for rank, (log, _) in enumerate(saved):
        assert all(agreed and len(set(names)) == 1 for _, names, agreed in log), (rank, log)
        assert [names[0] for _, names, _ in log] == SAVE_ORDER
    for rank, (log, objects) in enumerate(loaded):
        assert all(agreed and len(set(names)) == 1 for _, names, agreed in log), (rank, log)
        # a load first calls state_dict() (to know what to fill), then load_state_dict()
        assert [(m, names[0]) for m, names, _ in log] == [("state_dict", n) for n in SAVE_ORDER] + [
            ("load_state_dict", n) for n in LOAD_ORDER
        ]
        assert objects == sorted((n, n, [float(len(n))] * 2) for n in SAVE_ORDER)
