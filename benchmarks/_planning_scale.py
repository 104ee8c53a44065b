"""Scale on paper (``benchmarks/planning.py --only scale``): a 405B dense model and its Adam state
saved by up to 16,384 simulated ranks, pure planning in one process.

The job: Llama-3-405B's shapes (126 layers, hidden 16,384, 128 heads with 8 KV heads, FFN 53,248,
vocabulary 128,256: 1,137 parameters, 405.8 B elements) and, per parameter, Adam's ``exp_avg``,
``exp_avg_sq`` (sharded like the parameter) and ``step`` (a 0-d tensor every holder of the
parameter has): 4,548 tensors. Laid out as pipeline 16 x tensor-parallel 8 x FSDP ``dp``
(``rank = (stage * dp + d) * 8 + t``): stage ``s`` holds layers ``[s * 126 // 16, (s + 1) * 126
// 16)`` (the embedding on stage 0, final norm and output on stage 15); column-parallel weights
(``wq wk wv w1 w3``, embedding, output) are cut along dim 0 by TP then FSDP (one row range per
rank), row-parallel ones (``wo w2``) along dim 1 by TP and dim 0 by FSDP (a 128 x 8 grid at
``dp`` = 128), norms along dim 0 by FSDP and replicated over TP; ``torch.chunk`` sizes
(the last shards smaller). ``dp`` = 8 .. 128 gives 1,024 .. 16,384 ranks.

Measured, per world size:

- **coordinator**: decoding every rank's local plan bytes, :func:`plan_global_save` (checks,
  replica assignment, the skeleton), :func:`assemble_manifest` of the reported chunks and
  :func:`encode_manifest`; seconds and peak memory (the process's high-water RSS over the
  step, from ``/proc/self/status`` after a reset, over its RSS before);
- **a rank's own share**: the coordinator cuts every rank's share out of its plan
  (:func:`encode_shares`, counted in the coordinator's time); a rank decodes and checks its own
  (:func:`decode_share` against its local plan: what the save protocol runs on every rank after
  the scatter). For comparison, on paper: the protocol before this one (every rank decoded
  every local plan and planned the whole save), and the alternative of one broadcast of the
  whole plan (its skeleton's columns, compressed as a manifest's) that every rank decodes and
  slices itself (:meth:`GlobalSavePlan.for_rank`);
- **manifest** bytes against DCP's ``.metadata`` for the same state: torch's own ``Metadata``,
  ``TensorStorageMetadata`` / ``ChunkStorageMetadata`` per chunk and a ``MetadataIndex`` ->
  ``_StorageInfo`` per chunk (what ``FileSystemWriter`` pickles), pickled as DCP does. Built
  for ``--dcp-max`` ranks at most (it needs ~1 KiB of Python objects per chunk); larger worlds
  extrapolate it linearly in chunks (printed as such).
"""

from __future__ import annotations

import contextlib
import gc
import pickle
import time

import numpy as np

from cloudckpt.manifest.codec import encode_manifest
from cloudckpt.manifest.columns import decode_int_column, encode_int_column
from cloudckpt.manifest.lineage import HASH_BYTES
from cloudckpt.options import SaveOptions
from cloudckpt.planning.pieces import PieceHeader, PieceTable
from cloudckpt.planning.save.assemble import WrittenChunks, assemble_manifest
from cloudckpt.planning.save.global_plan import GlobalSavePlan, ManifestSkeleton, plan_global_save
from cloudckpt.planning.save.local_plan import (
    LocalSavePlan,
    decode_local_save_plan,
    encode_local_save_plan,
)
from cloudckpt.planning.save.share import decode_share, encode_shares
from cloudckpt.runtime.hugepages import without_huge_page_advice

PP, TP = 16, 8
LAYERS, HIDDEN, KV, FFN, VOCAB = 126, 16384, 1024, 53248, 128256
BLOCK = 4 << 20
MiB = 1 << 20
#: Whether a save records chunk hashes by default (it does: the manifest then holds them)
HASHED = SaveOptions().content_hashes

# (name, shape, kind): "col" TP along dim 0, "row" TP along dim 1, "norm" replicated over TP
_LAYER = (
    ("attention.wq.weight", (HIDDEN, HIDDEN), "col"),
    ("attention.wk.weight", (KV, HIDDEN), "col"),
    ("attention.wv.weight", (KV, HIDDEN), "col"),
    ("attention.wo.weight", (HIDDEN, HIDDEN), "row"),
    ("feed_forward.w1.weight", (FFN, HIDDEN), "col"),
    ("feed_forward.w3.weight", (FFN, HIDDEN), "col"),
    ("feed_forward.w2.weight", (HIDDEN, FFN), "row"),
    ("attention_norm.weight", (HIDDEN,), "norm"),
    ("ffn_norm.weight", (HIDDEN,), "norm"),
)


def stage_params(stage: int) -> list[tuple[str, tuple[int, ...], str]]:
    """The parameters of pipeline stage ``stage``."""
    out = []
    if stage == 0:
        out.append(("tok_embeddings.weight", (VOCAB, HIDDEN), "col"))
    for layer in range(stage * LAYERS // PP, (stage + 1) * LAYERS // PP):
        out += [(f"layers.{layer}.{n}", shape, kind) for n, shape, kind in _LAYER]
    if stage == PP - 1:
        out += [("norm.weight", (HIDDEN,), "norm"), ("output.weight", (VOCAB, HIDDEN), "col")]
    return out


def _chunk(n: int, parts: int, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``torch.chunk``'s (start, size) of part ``i`` of ``n`` rows."""
    per = -(-n // parts)
    start = np.minimum(per * i, n)
    return start, np.minimum(per, n - start)


class Job:
    """The job at FSDP degree ``dp`` (world ``PP * TP * dp``): per stage a header and, per rank
    of the stage, its piece columns (built on demand)."""

    def __init__(self, dp: int):
        self.dp = dp
        self.world = PP * TP * dp
        self.headers: list[PieceHeader] = []
        self.params: list[list[tuple[str, tuple[int, ...], str]]] = []
        for s in range(PP):
            params = stage_params(s)
            names, dtypes, shapes = [], [], []
            for prefix, dtype in (
                ("model.", "bfloat16"),
                ("optim.exp_avg.", "float32"),
                ("optim.exp_avg_sq.", "float32"),
            ):
                for n, shape, _ in params:
                    names.append(prefix + n)
                    dtypes.append(dtype)
                    shapes.append(shape)
            for n, _, _ in params:
                names.append("optim.step." + n)
                dtypes.append("float32")
                shapes.append(())
            self.headers.append(PieceHeader(names, dtypes, shapes))
            self.params.append(params)
        self.tensors = sum(len(h.names) for h in self.headers)
        self.elements = sum(
            int(np.prod(shape)) for p in self.params for _, shape, _ in p
        )  # parameters

    def local_plan(self, rank: int) -> LocalSavePlan:
        stage, rest = divmod(rank, TP * self.dp)
        d, t = divmod(rest, TP)
        params = self.params[stage]
        offs: list[int] = []
        sizes: list[int] = []
        for _, shape, kind in params:
            if kind == "norm":
                o, z = _chunk(shape[0], self.dp, np.array(d))
                offs.append(int(o))
                sizes.append(int(z))
            elif kind == "col":
                to, tz = _chunk(shape[0], TP, np.array(t))
                o, z = _chunk(int(tz), self.dp, np.array(d))
                offs += [int(to + o), 0]
                sizes += [int(z), shape[1]]
            else:
                o, z = _chunk(shape[0], self.dp, np.array(d))
                co, cz = _chunk(shape[1], TP, np.array(t))
                offs += [int(o), int(co)]
                sizes += [int(z), int(cz)]
        offs, sizes = offs * 3, sizes * 3  # the parameter, exp_avg, exp_avg_sq
        n = len(self.headers[stage].names)
        table = PieceTable(
            self.headers[stage], np.arange(n), np.array(offs), np.array(sizes), np.ones(n, bool)
        )
        return LocalSavePlan(rank=rank, world_size=self.world, pieces=table, value_names=())


def fake_written(skeleton, world: int) -> list[WrittenChunks]:
    """Every rank reports its chunks in one object each, one crc per started 4 MiB and, when
    saves record them by default (:data:`HASHED`), random 8-byte content hashes (incompressible,
    like real ones)."""
    order = np.argsort(skeleton.writer, kind="stable")
    bounds = np.searchsorted(skeleton.writer[order], np.arange(world + 1))
    out = []
    for r in range(world):
        ids = order[bounds[r] : bounds[r + 1]]
        lens = skeleton.nbytes[ids]
        offs = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
        ncrc = int(np.maximum(1, -(-lens // BLOCK)).sum())
        out.append(
            WrittenChunks(
                rank=r,
                object_keys=(f"data/0123456789abcdef/r{r:05d}-0000.bin",),
                chunk_ids=ids,
                object_index=np.zeros(len(ids), np.int64),
                byte_offset=offs,
                byte_length=lens,
                crcs=np.zeros(ncrc, np.int64),
                values={},
                hashes=np.random.default_rng(r).bytes(HASH_BYTES * len(ids)) if HASHED else b"",
            )
        )
    return out


def rss_hwm_reset() -> int:
    """Reset the high-water RSS to the current RSS; returns it (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def dcp_metadata_bytes(skeleton, names, dtypes, shapes, written) -> int:
    """Size of DCP's pickled ``.metadata`` for these chunks, built with torch's own classes."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    where: dict[int, tuple[str, int, int]] = {}
    for w in written:
        for c, o, n in zip(w.chunk_ids.tolist(), w.byte_offset.tolist(), w.byte_length.tolist()):
            where[c] = (f"__{w.rank}_0.distcp", o, n)
    sd_meta, storage = {}, {}
    for i, name in enumerate(names):
        nd = len(shapes[i])
        s, e = int(skeleton.chunk_start[i]), int(skeleton.chunk_start[i + 1])
        chunks = []
        for c in range(s, e):
            off = torch.Size(skeleton.offsets[c, :nd].tolist())
            chunks.append(
                ChunkStorageMetadata(offsets=off, sizes=torch.Size(skeleton.sizes[c, :nd].tolist()))
            )
            path, o, n = where[c]
            storage[MetadataIndex(fqn=name, offset=off, index=c - s)] = _StorageInfo(
                relative_path=path, offset=o, length=n
            )
        sd_meta[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=tdt[dtypes[i]]),
            size=torch.Size(shapes[i]),
            chunks=chunks,
        )
    meta = Metadata(state_dict_metadata=sd_meta, storage_data=storage)
    return len(pickle.dumps(meta))


class _Clock:
    """Wall and process CPU seconds of a block (``with _Clock() as c: ...; c.wall, c.cpu``)."""

    def __enter__(self):
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self._w
        self.cpu = time.process_time() - self._c


def run_world(dp: int, dcp_max: int, advice: bool = False) -> dict:
    job = Job(dp)
    world = job.world
    with _Clock() as local:
        encoded = [encode_local_save_plan(job.local_plan(r)) for r in range(world)]
    gc.collect()
    base = rss_hwm_reset()
    # the coordinator's blocks run as the save protocol runs them: without numpy's huge-page
    # advice (runtime.hugepages), unless --numpy-advice
    coordinator = contextlib.nullcontext if advice else without_huge_page_advice
    with coordinator(), _Clock() as dec:
        plans = [decode_local_save_plan(e) for e in encoded]
    with coordinator(), _Clock() as planned:
        plan = plan_global_save(plans, rank=0)
    with coordinator(), _Clock() as cut:  # the coordinator cuts every rank's share
        shares = encode_shares(plan)
    sk = plan.skeleton
    written = fake_written(sk, world)  # what the ranks report: not the coordinator's work
    with coordinator(), _Clock() as man:
        manifest = assemble_manifest(
            sk, written, world_size=world, checksum_block_size=BLOCK, created_at=0.0, hashed=HASHED
        )
        data = encode_manifest(manifest)
    peak = _status("VmHWM") - base
    del manifest
    with _Clock() as rank_plan:  # the previous protocol: every rank planned the whole save
        last = plan_global_save(plans, rank=world - 1)
    own = job.local_plan(world - 1)
    with _Clock() as share:  # this protocol: a rank decodes and checks its share
        mine = decode_share(shares[world - 1], own)
    assert [(c, p) for c, p, _, _ in mine.boxes()] == [
        (w.chunk_id, w.piece_index) for w in last.writes
    ]
    whole, bcast = broadcast_alternative(plan, world - 1)
    res = {
        "world": world,
        "dp": dp,
        "tensors": job.tensors,
        "pieces": int(sum(len(p.table) for p in plans)),
        "chunks": sk.num_chunks,
        "local_plan_ms": local.cpu / world * 1e3,
        "plan_bytes": int(np.mean([len(e) for e in encoded])),
        "decode": (dec.wall, dec.cpu),
        "plan": (planned.wall, planned.cpu),
        "cut": (cut.wall, cut.cpu),
        "manifest": (man.wall, man.cpu),
        "coordinator": (
            dec.wall + planned.wall + cut.wall + man.wall,
            dec.cpu + planned.cpu + cut.cpu + man.cpu,
        ),
        "before": (dec.wall + rank_plan.wall, dec.cpu + rank_plan.cpu),
        "share": (share.wall, share.cpu),
        "share_bytes": len(shares[world - 1]),
        "shares_bytes": sum(len(x) for x in shares),
        "max_share_bytes": max(len(x) for x in shares),
        "whole_bytes": whole,
        "whole": bcast,
        "peak_bytes": peak,
        "rank_writes": len(last.writes),
        "manifest_bytes": len(data),
        "dcp_bytes": None,
        "dcp_extrapolated": False,
    }
    del plans, encoded, last, mine, shares
    if world <= dcp_max:
        with _Clock() as dcp:
            res["dcp_bytes"] = dcp_metadata_bytes(sk, sk.names, sk.dtypes, sk.shapes, written)
        res["dcp_s"] = dcp.wall
    gc.collect()
    return res


_WHOLE = ("chunk_start", "offsets", "sizes", "writer")


def broadcast_alternative(plan: GlobalSavePlan, rank: int) -> tuple[int, tuple[float, float]]:
    """The other protocol, on paper: the coordinator broadcasts its whole plan (the skeleton's
    integer columns and each chunk's writer piece and start inside it, as manifest columns:
    delta, narrowest width, zlib); every rank decodes all of it and slices its own share
    (``for_rank``). Returns the broadcast's bytes and a rank's (wall, CPU) seconds."""
    sk = plan.skeleton
    cols = {n: getattr(sk, n) for n in _WHOLE} | {
        "writer_piece": plan.writer_piece,
        "within": plan.within,
    }
    encoded = {n: encode_int_column(np.asarray(a).reshape(-1), delta=True) for n, a in cols.items()}
    size = sum(len(c[4]) for c in encoded.values())
    with _Clock() as c:
        back = {n: decode_int_column(e).reshape(cols[n].shape) for n, e in encoded.items()}
        skeleton = ManifestSkeleton(
            sk.names, sk.dtypes, sk.shapes, *(back[n] for n in _WHOLE), sk.nbytes
        )
        whole = GlobalSavePlan(
            plan.world_size,
            0,
            (),
            skeleton,
            plan.value_owner,
            back["writer_piece"],
            back["within"],
        )
        whole.for_rank(rank)
    return size, (c.wall, c.cpu)


def _ws(pair: tuple[float, float]) -> str:
    return f"{pair[1]:.2f} s CPU ({pair[0]:.2f} s wall)"


def scale(worlds: list[int], dcp_max: int, advice: bool = False) -> list[dict]:
    """Run every world size; print one line each and the growth from the smallest."""
    print(
        "\n== scale on paper: 405B dense + Adam, pipeline 16 x TP 8 x FSDP dp, one process "
        "(seconds: process CPU, wall in parentheses: the machine is shared) =="
    )
    results = []
    for world in worlds:
        r = run_world(world // (PP * TP), dcp_max, advice)
        results.append(r)
        print(
            f"  {world:>6} ranks (dp {r['dp']}): {r['tensors']:,} tensors, {r['pieces']:,} "
            f"pieces, {r['chunks']:,} chunks; local plan {r['local_plan_ms']:.2f} ms/rank "
            f"({r['plan_bytes'] / 1024:.1f} KiB)\n"
            f"         coordinator {_ws(r['coordinator'])} = decode plans "
            f"{r['decode'][1]:.2f} + plan {r['plan'][1]:.2f} + cut shares {r['cut'][1]:.2f} + "
            f"manifest {r['manifest'][1]:.2f}; peak RSS +{r['peak_bytes'] / MiB:,.0f} MiB\n"
            f"         a rank: decode + check its share {r['share'][1] * 1e3:.1f} ms CPU "
            f"({r['share_bytes'] / 1024:.1f} KiB, {r['rank_writes']} writes; all shares "
            f"{r['shares_bytes'] / MiB:.1f} MiB scattered, the largest "
            f"{r['max_share_bytes'] / 1024:.1f} KiB)\n"
            f"         on paper: the previous protocol (every rank decodes every plan + plans "
            f"the whole save) {_ws(r['before'])}; one broadcast of the whole plan "
            f"{r['whole_bytes'] / 1024:,.0f} KiB to every rank, decoded + sliced by each "
            f"{_ws(r['whole'])}\n"
            f"         manifest {r['manifest_bytes'] / MiB:.2f} MiB "
            f"({r['manifest_bytes'] / r['chunks']:.1f} B/chunk"
            f"{', chunk hashes included' if HASHED else ''})"
            + (
                f"; DCP .metadata {r['dcp_bytes'] / MiB:.1f} MiB "
                f"({r['dcp_bytes'] / r['chunks']:.1f} B/chunk, built in {r['dcp_s']:.0f} s)"
                if r["dcp_bytes"]
                else ""
            ),
            flush=True,
        )
    measured = [r for r in results if r["dcp_bytes"]]
    if measured:
        per_chunk = measured[-1]["dcp_bytes"] / measured[-1]["chunks"]
        for r in results:
            if not r["dcp_bytes"]:
                r["dcp_bytes"] = int(per_chunk * r["chunks"])
                r["dcp_extrapolated"] = True
    first = results[0]
    print(f"  growth from {first['world']:,} ranks (x: world size / {first['world']:,}):")
    for r in results[1:]:
        g = r["world"] / first["world"]
        print(
            f"    x{g:<4g} chunks x{r['chunks'] / first['chunks']:.2f}, coordinator CPU "
            f"x{r['coordinator'][1] / first['coordinator'][1]:.2f}, peak RSS "
            f"x{r['peak_bytes'] / max(1, first['peak_bytes']):.2f}, a rank's share CPU "
            f"x{r['share'][1] / max(1e-9, first['share'][1]):.2f}, manifest "
            f"x{r['manifest_bytes'] / first['manifest_bytes']:.2f}"
        )
    return results


def targets(results: list[dict]) -> list[tuple[str, bool | None]]:
    """The issue's targets at the largest world (PASS/MISS lines, as the other benchmarks)."""
    import _common as C

    r = results[-1]
    w = f"[{r['world']:,} ranks]"
    dcp = "extrapolated from the largest world built" if r["dcp_extrapolated"] else "built"
    return [
        C.ratio_line(
            f"{w} coordinator planning (shares cut included) + manifest encoding, CPU s (wall "
            f"{r['coordinator'][0]:.2f} s)",
            r["coordinator"][1],
            10.0,
            1.0,
        ),
        C.ratio_line(f"{w} coordinator peak RSS growth, MiB", r["peak_bytes"] / MiB, 4096, 1.0),
        C.ratio_line(
            f"{w} a rank's own share of the plan (decode + check its scattered share), CPU s",
            r["share"][1],
            1.0,
            1.0,
        ),
        C.ratio_line(
            f"{w} manifest bytes / DCP .metadata bytes ({dcp})",
            r["manifest_bytes"],
            r["dcp_bytes"],
            0.1,
        ),
    ]
