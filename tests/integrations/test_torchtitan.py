"""cloudckpt.integrations.torchtitan on 2 gloo ranks against SeaweedFS: torchtitan 0.3's own
CheckpointManager (subclassed), OptimizersContainer and LRSchedulersContainer around a tiny
FSDP2 model, torchtitan's loop (load, save every interval, last step); stopped, resumed from S3
in a fresh state: the losses after the resume equal an uninterrupted run's and the final model,
optimizer and scheduler states are equal exactly; keep_latest_k prunes through cloudckpt.
The async mode is slow (DCP's staging and background gloo group; its steps are the same)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "torchtitan.components.checkpoint", reason="pip install 'cloudckpt[torchtitan]'"
)

from tests.integrations.dcp_training import build_model, full_state, same, train_step  # noqa: E402


class Counter:
    """A Stateful train state and data loader position, as torchtitan keeps them."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def rank_titan(url: str, *, until: int, total: int, mode: str, seed: int) -> dict:
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        OptimizersContainer,
        ParamGroupConfig,
    )

    from cloudckpt.integrations.torchtitan import CheckpointManager

    model = build_model(seed)
    optim = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "eps": 1e-8}
            )
        ],
        implementation="for-loop",
    ).build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optim, training_steps=total
    )
    train_state, data = Counter(), Counter()
    checkpointer = CheckpointManager.Config(
        enable=True,
        folder=url,
        interval=2,
        keep_latest_k=2,
        async_mode=mode,
        last_save_model_only=False,
    ).build(
        dataloader=data,
        model_parts=[model],
        optimizers=optim,
        lr_schedulers=sched,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder="",
    )
    resumed = checkpointer.load()
    start = train_state.step
    losses = {}
    for step in range(start + 1, until + 1):
        checkpointer.maybe_wait_for_staging()
        losses[step] = train_step(model, optim, sched, step)
        train_state.step = data.step = step
        checkpointer.save(step, last_step=step == total)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    inner_sched = sched.schedulers[0]
    return {
        "resumed": resumed,
        "start": start,
        "losses": losses,
        "final": full_state(model, optim.optimizers[0], inner_sched),
    }


def _complete(url: str) -> list[int | None]:
    from cloudckpt.integrations.dcp_trainer import DCPRun

    return [c.step for c in DCPRun(url).list() if c.complete]


@pytest.mark.parametrize("mode", ["disabled", pytest.param("async", marks=pytest.mark.slow)])
def test_torchtitan_resumes_from_s3_exactly(world2, s3_env, s3_url, mode):
    whole = world2.run(rank_titan, f"{s3_url}/whole", until=8, total=8, mode=mode, seed=0)
    world2.run(rank_titan, f"{s3_url}/part", until=4, total=8, mode=mode, seed=0)  # stopped
    resumed = world2.run(rank_titan, f"{s3_url}/part", until=8, total=8, mode=mode, seed=9)
    for rank in (0, 1):
        assert whole[rank]["resumed"] is False
        assert resumed[rank]["resumed"] is True and resumed[rank]["start"] == 4
        assert resumed[rank]["losses"] == {s: whole[rank]["losses"][s] for s in (5, 6, 7, 8)}
        assert same(resumed[rank]["final"], whole[rank]["final"])
    assert whole[0]["final"]["sched"]["last_epoch"] == 8
    # keep_latest_k=2 after each interval save; the last step's save is not followed by a purge
    # (torchtitan's own order), so 8 joins the two kept
    assert _complete(f"{s3_url}/whole") == [4, 6, 8] == _complete(f"{s3_url}/part")
