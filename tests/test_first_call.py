"""The first save and load in a fresh process import only what they need (the fixed cost of a
first call, issue 27): no ``torch.distributed.tensor`` (sympy, torch.fx: a second or more) for
a state without DTensors, no DCP, and the S3 client's packages (aiobotocore, botocore,
aiohttp) only once an ``s3://`` store is opened. Not timed: what is imported is checked, in a
fresh process (a world of one forked from the harness's zygote, which imported torch only)."""

from __future__ import annotations

import sys

from cloudckpt.testing.ranks.world import ProcessWorld

NEVER = ("torch.distributed.tensor", "sympy", "torch.distributed.checkpoint", "torch._dynamo")
S3_ONLY = ("aiobotocore", "botocore", "aiohttp")


def _loaded() -> list[str]:
    return sorted(n for n in NEVER + S3_ONLY if n in sys.modules)


def rank_first_calls(local_url: str, s3_url: str) -> dict:
    import torch

    out = {"before": _loaded()}
    import cloudckpt

    state = {"w": torch.arange(6.0).reshape(2, 3), "nested": {"b": torch.ones(4)}, "step": 3}
    back = {"w": torch.zeros(2, 3), "nested": {"b": torch.zeros(4)}, "step": 0}
    out["import"] = _loaded()
    cloudckpt.save(state, local_url)
    cloudckpt.load(back, local_url)
    out["file_ok"] = torch.equal(back["w"], state["w"]) and back["step"] == 3
    out["file"] = _loaded()
    cloudckpt.save(state, s3_url)
    cloudckpt.load(back, s3_url)
    out["s3"] = _loaded()
    return out


def test_a_first_save_and_load_import_only_what_they_need(tmp_path, s3_server, s3_url):
    with ProcessWorld(1, env=s3_server.env()) as world:
        out = world.run(rank_first_calls, str(tmp_path / "ck"), s3_url)[0]
    assert out["before"] == [], "the fresh process is not fresh"
    assert out["import"] == [], "import cloudckpt imports these"
    assert out["file_ok"]
    assert out["file"] == [], "a file:// save and load import these"
    assert set(out["s3"]) <= set(S3_ONLY) and "aiobotocore" in out["s3"], out["s3"]
