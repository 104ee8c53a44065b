"""infra/kubernetes/train-job.yaml and the image it runs (infra/docker/Dockerfile) hold together.

- The container's torchrun command is parsed with torchrun's own argument parser: an elastic c10d
  rendezvous hosted by pod 0 through the headless Service, a node range whose maximum is the
  Job's completions, ``--max-restarts``, and a batch every world size in the range divides.
- The pod mounts a memory-backed, size-capped emptyDir at /dev/shm and states requests and
  limits, with the memory limit above the /dev/shm cap (its pages count against the limit).
- The grace period covers the preemption save (the budget in infra/README.md).
- The Dockerfile (parsed with dockerfile-parse) installs torch==2.13.0 before the package, copies
  only files the build context has (Dockerfile.dockerignore) and puts examples/train.py where the
  Job's command looks for it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
JOB_FILE = ROOT / "infra" / "kubernetes" / "train-job.yaml"
DOCKERFILE = ROOT / "infra" / "docker" / "Dockerfile"

_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_FACTORS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def quantity(text) -> float:
    """A Kubernetes quantity (``512Gi``, ``64``, ``1.5G``) as a number."""
    m = _QUANTITY.match(str(text))
    assert m, f"not a Kubernetes quantity: {text!r}"
    return float(m.group(1)) * _FACTORS[m.group(2)]


def manifests() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(JOB_FILE.read_text()) if d}


def trainer(pod: dict) -> dict:
    return next(c for c in pod["containers"] if c["name"] == "trainer")


def torchrun_argv(container: dict) -> list[str]:
    """The torchrun command line of the container's bash script, its variables expanded from the
    container's env (JOB_COMPLETION_INDEX as the Job sets it for pod 0)."""
    script = container["args"][0]
    joined = re.sub(r"\\\n\s*", " ", script)
    line = next(ln for ln in joined.splitlines() if ln.strip().startswith("torchrun "))
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["JOB_COMPLETION_INDEX"] = "0"

    def expand(m):
        assert m.group(1) in env, f"${m.group(1)} is not set in the container"
        return env[m.group(1)]

    line = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", expand, line).strip()
    return shlex.split(line.removesuffix("&"))


def test_torchrun_rendezvous_is_elastic_through_the_headless_service():
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    docs = manifests()
    job, service = docs["Job"], docs["Service"]
    pod = job["spec"]["template"]["spec"]
    argv = torchrun_argv(trainer(pod))
    assert argv[0] == "torchrun"
    args = get_args_parser().parse_args(argv[1:])  # unknown flags fail here

    assert args.rdzv_backend == "c10d" and not args.standalone
    assert args.rdzv_id and args.rdzv_id != "none"
    # static-rendezvous flags would be ignored (or conflict) under c10d: none are given
    assert not {"--node-rank", "--node_rank", "--master-addr", "--master_addr"} & set(argv)
    # pod 0 hosts the store: <job>-0.<subdomain>:<port>, the headless Service resolving it
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert service["metadata"]["name"] == pod["subdomain"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    assert int(port) in {p["containerPort"] for p in trainer(pod)["ports"]}

    low, high = parse_min_max_nnodes(args.nnodes)
    assert 1 <= low < high == job["spec"]["completions"] == job["spec"]["parallelism"], (
        "elastic: fewer pods than the Job's may go on; never more than it runs"
    )
    assert args.max_restarts >= 1, "a lost pod must restart the survivors' workers, not end them"
    assert args.training_script == "examples/train.py"
    batch = int(args.training_script_args[args.training_script_args.index("--batch") + 1])
    for nodes in range(low, high + 1):
        assert batch % (int(args.nproc_per_node) * nodes) == 0, f"--batch {batch}, {nodes} pods"


def test_container_script_is_valid_bash():
    import shutil
    import subprocess

    container = trainer(manifests()["Job"]["spec"]["template"]["spec"])
    assert container["command"][:2] == ["/bin/bash", "-c"]
    bash = shutil.which("bash")
    assert bash, "bash is needed to check the script"
    proc = subprocess.run([bash, "-n", "-c", container["args"][0]], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_pod_has_a_sized_dev_shm_and_resource_requests():
    pod = manifests()["Job"]["spec"]["template"]["spec"]
    container = trainer(pod)
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    assert "/dev/shm" in mounts, "the default 64 MiB /dev/shm is too small for NCCL/gloo"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
    assert volume["emptyDir"]["medium"] == "Memory"
    shm = quantity(volume["emptyDir"]["sizeLimit"])
    assert shm >= 2**30

    resources = container["resources"]
    for kind in ("cpu", "memory"):
        assert kind in resources["requests"] and kind in resources["limits"], kind
        assert quantity(resources["requests"][kind]) <= quantity(resources["limits"][kind])
    gpus = resources["limits"].get("nvidia.com/gpu")
    if gpus is not None:  # extended resources: a request, if given, equals the limit
        assert resources["requests"].get("nvidia.com/gpu", gpus) == gpus
        assert int(gpus) == int(
            next(e["value"] for e in container["env"] if e["name"] == "NPROC_PER_NODE")
        )
    assert quantity(resources["limits"]["memory"]) > shm, (
        "/dev/shm pages count against the memory limit: it must exceed the sizeLimit"
    )


def test_job_matches_the_preemption_budget():
    spec = manifests()["Job"]["spec"]
    pod = spec["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    assert pod["restartPolicy"] == "Never"
    ignored = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "Ignore"]
    assert any(143 in r.get("onExitCodes", {}).get("values", []) for r in ignored)
    assert any(
        c["type"] == "DisruptionTarget" for r in ignored for c in r.get("onPodConditions", [])
    )
    command = " ".join(trainer(pod)["args"])
    # PID 1 forwards SIGTERM, and a preemption save becomes exit status 143
    assert "trap 'kill -TERM" in command and "--preempted-marker" in command
    assert "exit 143" in command
    shutdown = int(re.search(r"--shutdown-timeout\s+(\d+)", command).group(1))
    assert shutdown < pod["terminationGracePeriodSeconds"] <= 120  # AWS spot notice: 2 minutes
    lines = JOB_FILE.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "terminationGracePeriodSeconds:" in line)
    comment = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#"):
            break
        comment.append(line)
    assert "--shutdown-timeout" in " ".join(comment) and "save" in " ".join(comment), (
        "the grace period needs the comment above it that explains the match"
    )


# -- the image ------------------------------------------------------------------------------------


def dockerfile() -> list[dict]:
    """Instructions of infra/docker/Dockerfile: dicts with ``instruction`` and ``value``."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(path=str(DOCKERFILE), env_replace=False)
    return [i for i in parser.structure if i["instruction"] != "COMMENT"]


def _index(instructions, predicate, what) -> int:
    found = [n for n, i in enumerate(instructions) if predicate(i)]
    assert found, f"the Dockerfile has no {what}"
    return found[0]


def test_dockerfile_installs_pinned_torch_before_the_package():
    ins = dockerfile()
    assert ins[0]["instruction"] in ("FROM", "ARG")
    runs = [(n, i["value"]) for n, i in enumerate(ins) if i["instruction"] == "RUN"]
    torch_at = _index(
        ins,
        lambda i: (
            i["instruction"] == "RUN"
            and re.search(r"pip install .*\btorch==2\.13\.0\b", i["value"])
        ),
        "RUN pip install ... torch==2.13.0",
    )
    assert "--index-url" in ins[torch_at]["value"], "torch from a wheel index of one build (CPU)"
    package_at = _index(
        ins,
        lambda i: (
            i["instruction"] == "RUN" and re.search(r"pip install (?!.*torch)\S*/src\b", i["value"])
        ),
        "RUN pip install /src",
    )
    assert torch_at < package_at
    first_pip = min(n for n, v in runs if "pip install" in v)
    assert first_pip == torch_at, "nothing may pull a torch in before the pinned one"
    copies = [
        n
        for n, i in enumerate(ins)
        if i["instruction"] == "COPY"
        and ("cloudckpt" in i["value"] or "pyproject.toml" in i["value"])
    ]
    assert copies and max(copies) < package_at


def _copies(ins) -> list[tuple[list[str], str]]:
    out = []
    for i in ins:
        if i["instruction"] == "COPY":
            parts = [p for p in shlex.split(i["value"]) if not p.startswith("--")]
            out.append((parts[:-1], parts[-1]))
    return out


def test_dockerfile_copies_only_what_the_build_context_holds():
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in ignore if p.strip() and not p.startswith("#")]
    assert patterns[0] == "*", "everything out, then what the Dockerfile copies back in"
    included = {p[1:] for p in patterns if p.startswith("!")}
    for sources, _ in _copies(dockerfile()):
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert PurePosixPath(src).parts[0] in included, f"COPY {src}: excluded from the context"


def test_image_holds_the_script_the_job_runs():
    ins = dockerfile()
    workdir = [i["value"] for i in ins if i["instruction"] == "WORKDIR"][-1]
    script = PurePosixPath(workdir) / "examples" / "train.py"
    assert any(
        PurePosixPath(dest) in (script.parent, script.parent.parent)
        or PurePosixPath(dest) == script
        for _, dest in _copies(ins)
    ), f"{script} is not copied into the image"
    assert (ROOT / "examples" / "train.py").is_file()
    user = [i["value"] for i in ins if i["instruction"] == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0"), "the trainer does not run as root"
    image = trainer(manifests()["Job"]["spec"]["template"]["spec"])["image"]
    assert image.split(":")[0] in DOCKERFILE.read_text(), "the build command tags the Job's image"


@pytest.mark.parametrize(
    "text, value", [("64Gi", 64 * 2**30), ("512Gi", 512 * 2**30), ("64", 64), ("1.5G", 1.5e9)]
)
def test_quantity(text, value):
    assert quantity(text) == value
