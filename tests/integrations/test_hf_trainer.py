"""transformers.Trainer with cloudckpt checkpoints on the local SeaweedFS (a tiny Llama with
dropout, CPU): saves at save_steps, a resume from S3 that continues exactly as an uninterrupted
run, save_total_limit pruning, an export that from_pretrained loads, and the one-line errors."""

from __future__ import annotations

import glob
import json
import os
import tempfile

import pytest
import torch

import cloudckpt
from cloudckpt.errors import CheckpointNotFound, ConfigError, ManifestError, StorageError
from cloudckpt.integrations.run_folder import complete_checkpoints
from tests.integrations.hf_models import (
    TokenData,
    assert_same_optimizer,
    losses,
    stop_at,
    tiny_model,
    trainer_args,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs(s3_server, tmp_path_factory):
    """An uninterrupted 4-step run (``full``), one stopped after its step-2 checkpoint
    (``stopped``, saving with ``async_save``), and a third resumed from S3 (``resumed``): each
    a (trainer, run URL)."""
    from cloudckpt.integrations.hf_trainer import CloudckptTrainer

    tmp = tmp_path_factory.mktemp("hf")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server.env().items():
            mp.setenv(key, value)
        base = s3_server.url(f"hf-trainer-{os.getpid()}-{os.urandom(4).hex()}")
        out = {}
        # the stopped run saves asynchronously: its checkpoints are what the resume reads
        for name, extra, limit, asynchronous in (
            ("full", [], 1, False),
            ("stopped", [stop_at(2)], None, True),
        ):
            url = f"{base}/{name}"
            t = CloudckptTrainer(
                checkpoint_url=url,
                async_save=asynchronous,
                model=tiny_model(),
                args=trainer_args(tmp / name, save_total_limit=limit),
                train_dataset=TokenData(),
                callbacks=extra,
            )
            t.train()
            out[name] = (t, url)
        stopped_url = out["stopped"][1]
        out["checkpoints_after_stop"] = complete_checkpoints(stopped_url, "checkpoint-")
        staged_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "cloudckpt-resume-*")))
        t = CloudckptTrainer(
            checkpoint_url=stopped_url,
            model=tiny_model(seed=5),  # other weights: the resume must load them
            args=trainer_args(tmp / "resumed"),
            train_dataset=TokenData(),
        )
        t.train(resume_from_checkpoint="latest")
        out["resumed"] = (t, stopped_url)
        out["staged_left"] = (
            set(glob.glob(os.path.join(tempfile.gettempdir(), "cloudckpt-resume-*")))
            - staged_before
        )
        out["tmp"] = tmp
        yield out


def test_a_resume_from_s3_continues_as_the_uninterrupted_run(runs):
    full, _ = runs["full"]
    stopped, _ = runs["stopped"]
    resumed, _ = runs["resumed"]
    want = losses(full.state.log_history)
    assert sorted(losses(stopped.state.log_history)) == [1, 2]
    got = losses(resumed.state.log_history)
    assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]  # dropout: RNG came back
    assert resumed.state.global_step == 4
    assert_same_optimizer(full.optimizer.state_dict(), resumed.optimizer.state_dict())
    assert full.lr_scheduler.state_dict() == resumed.lr_scheduler.state_dict()
    for k, v in full.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


def test_checkpoints_go_to_s3_only_and_save_total_limit_prunes(runs):
    _, full_url = runs["full"]
    # save_total_limit=1: only the newest complete one stays
    assert [c.name for c in complete_checkpoints(full_url, "checkpoint-")] == ["checkpoint-4"]
    assert [c.step for c in runs["checkpoints_after_stop"]] == [2]
    # nothing written locally: no checkpoint folder in output_dir; the staged state file is gone
    assert glob.glob(str(runs["tmp"] / "*" / "checkpoint-*")) == []
    assert runs["staged_left"] == set()
    stored = cloudckpt.load_full(f"{full_url}/checkpoint-4")
    assert set(stored) >= {"model", "optimizer", "scheduler", "rng", "trainer_state"}
    assert json.loads(stored["trainer_state"])["global_step"] == 4
    assert isinstance(stored["rng"]["rank0"]["torch"], torch.Tensor)
    assert cloudckpt.read_manifest(f"{full_url}/checkpoint-4").metadata["step"] == 4


def test_the_export_of_a_checkpoint_loads_with_from_pretrained(runs, s3_env, tmp_path):
    from transformers import LlamaForCausalLM

    from cloudckpt.cli.main import main

    stopped, url = runs["stopped"]
    ckpt = f"{url}/checkpoint-2"
    folder = tmp_path / "export"
    assert main(["export", ckpt, str(folder), "--format", "safetensors", "--prefix", "model."]) == 0
    (folder / "config.json").write_text(cloudckpt.read_manifest(ckpt).values["model_config"])
    model = LlamaForCausalLM.from_pretrained(folder)
    for k, v in stopped.model.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_resume_errors_are_cloudckpt_one_liners(runs, s3_env, s3_url):
    from cloudckpt.integrations.hf_trainer import CloudckptTrainer

    def trainer(url):
        return CloudckptTrainer(
            checkpoint_url=url,
            model=tiny_model(),
            args=trainer_args(runs["tmp"] / "errors"),
            train_dataset=TokenData(),
        )

    for unsupported in ("push_to_hub", "load_best_model_at_end"):
        with pytest.raises(ConfigError, match=f"does not support {unsupported}"):
            CloudckptTrainer(
                checkpoint_url=s3_url,
                model=tiny_model(),
                args=trainer_args(
                    runs["tmp"] / "errors", eval_strategy="steps", **{unsupported: True}
                ),
            )
    t = trainer(s3_url)
    assert t.latest_checkpoint() is None
    with pytest.raises(CheckpointNotFound, match="no complete checkpoint-<N> checkpoint under"):
        t.train(resume_from_checkpoint=True)
    with pytest.raises(CheckpointNotFound) as err:
        t.train(resume_from_checkpoint=f"{s3_url}/checkpoint-9")
    assert "\n" not in str(err.value)
    # hostile: a checkpoint whose trainer state is not the Trainer's record
    for bad in ("not json", json.dumps({"global_step": 1, "no_such_field": 2}), 7):
        bad_url = f"{s3_url}/bad-{abs(hash(str(bad)))}"
        cloudckpt.save({"model": {}, "trainer_state": bad}, bad_url)
        with pytest.raises(ManifestError, match="trainer_state|no trainer_state"):
            t.train(resume_from_checkpoint=bad_url)
        assert cloudckpt.read_manifest(bad_url)  # nothing deleted
    # another model's weights (and so another optimizer's state): one line, no traceback text
    from transformers import LlamaConfig, LlamaForCausalLM

    other = CloudckptTrainer(
        checkpoint_url=runs["stopped"][1],
        model=LlamaForCausalLM(
            LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
        ),
        args=trainer_args(runs["tmp"] / "other"),
        train_dataset=TokenData(),
    )
    with pytest.raises(
        ManifestError, match="the stored model weights cannot be loaded into this run"
    ) as err:
        other.train(resume_from_checkpoint="latest")
    assert "\n" not in str(err.value)
    # a bucket that does not exist fails when train() starts, before any step
    with pytest.raises(StorageError) as err:
        trainer(f"s3://no-such-bucket-{os.getpid()}/run").train()
    assert "\n" not in str(err.value)
