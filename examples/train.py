"""Train a small transformer with FSDP2 and checkpoint it to S3 with cloudckpt.

    torchrun --nproc-per-node 2 examples/train.py --url s3://bucket/runs/demo --steps 60
    python examples/train.py --url s3://bucket/runs/demo --steps 80    # one process

What it shows:

- parameters sharded with FSDP2 (``fully_shard``; gloo on CPU, NCCL when CUDA is there); the
  state is gathered with ``get_state_dict`` and restored with ``set_state_dict``;
- an asynchronous save every ``--save-every`` steps through ``cloudckpt.CheckpointManager``
  (``mgr.save(step, state, blocking=False)``) with a ``keep_last`` retention policy;
- on start, a resume from the newest *complete* checkpoint, whatever world size saved it;
- SIGTERM on any rank (a spot interruption, ``kubectl delete pod``, Slurm's ``--signal``; sent
  to torchrun, it is forwarded to every worker) goes through ``cloudckpt.PreemptionHandler``:
  every rank stops at the same step, saves it and exits with status 143 (torchrun itself then
  exits 1: ``--preempted-marker FILE`` tells a wrapper script that this was a preemption);
  with ``--spot-notices``, an EC2 spot interruption notice does the same (``cloudckpt.runs.spot``).

The data is synthetic and deterministic: the global batch of step ``s`` is a function of ``s``
only (token sequences of a seeded Markov chain), split over the ranks. A resumed run, on any
number of processes that divides ``--batch``, trains on the same batches and its loss continues
where the saved run stopped.

Storage: ``--url`` names the run (``s3://bucket/prefix``); endpoint and credentials come from
the standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...) or the usual AWS
chain. With neither ``--url`` nor ``AWS_ENDPOINT_URL``, rank 0 starts a private local SeaweedFS
for this run only (its checkpoints vanish when the run ends: use ``examples/demo.sh`` or
``python -m cloudckpt.testing.servers.seaweed`` for a server that outlives runs).

Every rank prints nothing; rank 0 prints one line per ``--log-every`` steps (step, loss, time)
and one per checkpoint event. ``--loss-log FILE`` appends ``step loss world_size`` lines.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cloudckpt
from cloudckpt.runs.preemption import Preempted

DEFAULT_BUCKET = "cloudckpt-test"


# -- model ----------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """A decoder-only language model over byte-sized tokens."""

    def __init__(self, *, vocab: int, dim: int, layers: int, heads: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# -- data -----------------------------------------------------------------------------------------


def successor_table(vocab: int, branching: int, seed: int) -> torch.Tensor:
    """The synthetic language: token ``t`` is followed by one of ``branching`` fixed successors."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (vocab, branching), generator=gen)


def global_batch(
    step: int, *, table: torch.Tensor, batch: int, seq_len: int, seed: int
) -> torch.Tensor:
    """The ``batch x (seq_len + 1)`` token sequences of ``step``: a function of ``step`` only."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    vocab, branching = table.shape
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    choices = torch.randint(0, branching, (batch, seq_len), generator=gen)
    for t in range(seq_len):
        tokens[:, t + 1] = table[tokens[:, t], choices[:, t]]
    return tokens


# -- distributed set-up ---------------------------------------------------------------------------


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun job if there is one (gloo on CPU, NCCL on CUDA); else a world of 1."""
    if "RANK" not in os.environ:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, device
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # cloudckpt's control channel and the preemption check use gloo groups of their own
        dist.init_process_group("cuda:nccl,cpu:gloo")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def share_bytes_from_rank0(payload: bytes) -> bytes:
    """Broadcast a small byte string from rank 0 (tensors only: nothing is pickled)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return payload
    length = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(length, src=0, group=_cpu_group())
    buf = torch.zeros(int(length.item()), dtype=torch.uint8)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=0, group=_cpu_group())
    return bytes(buf.tolist())


_CPU_GROUP = None


def _cpu_group():
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP


def resolve_storage(args, rank: int):
    """The run URL; starts a private local S3 server (rank 0 only) when none is configured.

    Returns ``(url, server_or_None)``."""
    if args.url:
        return args.url.rstrip("/"), None
    if os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"):
        raise SystemExit("AWS_ENDPOINT_URL is set: pass --url s3://<bucket>/<prefix> as well")
    server, env_lines = None, b""
    if rank == 0:
        from cloudckpt.testing.servers.seaweed.server import S3Server

        print(
            "train: no --url and no AWS_ENDPOINT_URL: starting a private local SeaweedFS "
            "(its checkpoints vanish when this run ends)",
            flush=True,
        )
        server = S3Server()
        info = server.start()
        env_lines = "\n".join(f"{k}={v}" for k, v in info.env().items()).encode()
    for line in share_bytes_from_rank0(env_lines).decode().splitlines():
        key, _, value = line.partition("=")
        os.environ[key] = value
    return f"s3://{DEFAULT_BUCKET}/train/run-{int(time.time())}", server


# -- training -------------------------------------------------------------------------------------


def build(args, world: int, device: torch.device):
    torch.manual_seed(args.seed)  # identical initial weights on every rank and world size
    model = TinyLM(
        vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, seq_len=args.seq_len
    ).to(device)
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    return model, optim


def checkpoint_state(model, optim, step: int) -> dict:
    """What a checkpoint holds: sharded model and optimizer state (DTensors under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def restore(mgr, model, optim) -> int:
    """Load the newest complete checkpoint (any world size) into model and optimizer.

    Returns its step, or 0 when the run has none."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = checkpoint_state(model, optim, 0)  # this rank's shards, to be filled in place
    step = mgr.load(state)
    if step is None:
        return 0
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def learning_rate(step: int, args) -> float:
    """Linear warm-up, then cosine decay to 10 %: a function of the step only."""
    if step <= args.warmup:
        return args.lr * step / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--url", help="run URL s3://bucket/prefix (default: a private local server)")
    p.add_argument("--steps", type=int, default=60, help="train up to this step")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--keep-last", type=int, default=3, help="retention: complete checkpoints kept")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=160)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--branching", type=int, default=4, help="successors per token in the data")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="sleep this long after each step (to leave time to interrupt a demo)",
    )
    p.add_argument("--pid-dir", help="write rank<R>.pid files here (to signal a given rank)")
    p.add_argument("--loss-log", help="append 'step loss world_size' lines to this file (rank 0)")
    p.add_argument(
        "--spot-notices",
        action="store_true",
        help="also stop as on SIGTERM at an EC2 spot interruption notice (polled by "
        "local rank 0 from the instance metadata: cloudckpt.SpotNoticePoller)",
    )
    p.add_argument(
        "--preempted-marker",
        help="every rank creates this file after a preemption save (a wrapper around "
        "torchrun, which exits 1 either way, can then exit 143)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, device = init_distributed()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not divisible by the world size {world}")
    if args.pid_dir:
        os.makedirs(args.pid_dir, exist_ok=True)
        with open(os.path.join(args.pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(f"{os.getpid()}\n")

    say_lock = threading.Lock()

    def say(msg: str) -> None:
        # one write per line, under a lock: a save's done callback says its line from the save
        # thread, and print() writes the text and its newline apart, so two lines could run
        # together ("... 0.15 strain: ...")
        if rank == 0:
            with say_lock:
                sys.stdout.write(msg + "\n")
                sys.stdout.flush()

    url, server = resolve_storage(args, rank)
    try:
        return train(args, rank, world, device, url, say)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if server is not None:
            server.stop()


def train(args, rank, world, device, url, say) -> int:
    model, optim = build(args, world, device)
    n_params = sum(p.numel() for p in model.parameters())  # global numel, also for DTensors
    say(
        f"train: {n_params / 1e6:.2f} M parameters, world size {world}, device {device.type}, "
        f"run {url}"
    )
    table = successor_table(args.vocab, args.branching, args.seed)
    mgr = cloudckpt.CheckpointManager(url, keep_last=args.keep_last)
    loss_log = open(args.loss_log, "a") if args.loss_log and rank == 0 else None

    with (
        cloudckpt.PreemptionHandler(mgr) as preempt,
        loss_log or nullcontext(),
        spot_notices(args, preempt),
    ):
        t0 = time.perf_counter()
        start = restore(mgr, model, optim)
        if start:
            say(
                f"train: resumed from step {start} (newest complete checkpoint) in "
                f"{time.perf_counter() - t0:.2f} s, world size {world}"
            )
        else:
            say("train: no checkpoint found: starting from step 0")
        last = time.perf_counter()
        for step in range(start + 1, args.steps + 1):
            tokens = global_batch(
                step, table=table, batch=args.batch, seq_len=args.seq_len, seed=args.seed
            )[rank::world].to(device)
            for group in optim.param_groups:
                group["lr"] = learning_rate(step, args)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()

            global_loss = loss.detach().float().cpu()
            if world > 1:
                dist.all_reduce(global_loss)
                global_loss /= world
            if loss_log is not None:
                loss_log.write(f"{step} {global_loss.item():.6f} {world}\n")
                loss_log.flush()
            if step % args.log_every == 0:
                now = time.perf_counter()
                say(
                    f"step {step:4d}  loss {global_loss.item():.4f}  "
                    f"({(now - last) / args.log_every:.2f} s/step)"
                )
                last = now

            if step % args.save_every == 0 or step == args.steps:
                save_async(mgr, step, checkpoint_state(model, optim, step), say)
            if preempt.should_stop(step):  # collective: every rank, every step
                t = time.perf_counter()
                say(
                    f"train: stop requested (SIGTERM or spot notice): saving step {step} and "
                    "exiting"
                )
                try:
                    preempt.save_and_exit(step, checkpoint_state(model, optim, step))
                except Preempted:  # saved on every rank: exit with status 143
                    say(
                        f"train: preemption checkpoint of step {step} done in "
                        f"{time.perf_counter() - t:.2f} s"
                    )
                    if args.preempted_marker:
                        with open(args.preempted_marker, "w") as f:
                            f.write(f"{step}\n")
                    raise
            if args.step_delay:
                time.sleep(args.step_delay)
        mgr.close()  # wait for the last asynchronous save (and its pruning)
    say(f"train: finished step {args.steps}")
    return 0


def spot_notices(args, preempt):
    """With --spot-notices, local rank 0 polls for a spot interruption notice, which stops the
    job as a SIGTERM does (the handler's agreement reaches every rank); else nothing."""
    if not args.spot_notices or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return nullcontext()
    return cloudckpt.SpotNoticePoller(preempt.request)


def save_async(mgr, step: int, state: dict, say) -> None:
    """Start an asynchronous save; training resumes once the shards are staged in host memory."""
    handle = mgr.save(step, state, blocking=False)
    say(f"[ckpt] step {step}: save started, training blocked {handle.inner.blocked_seconds:.2f} s")

    def done(h) -> None:
        exc = h.exception()
        if exc is not None:
            say(f"[ckpt] step {step}: save FAILED: {exc}")
        else:
            r = h.result()
            say(
                f"[ckpt] step {step}: committed {r.bytes_written / 2**20:.1f} MiB in {r.objects} "
                f"object(s), {r.seconds:.2f} s"
            )

    handle.add_done_callback(done)


if __name__ == "__main__":
    sys.exit(main())
