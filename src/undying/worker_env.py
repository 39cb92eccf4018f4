"""The environment contract between a node agent and each worker it starts: written in the agent
(``WorkerEnv.to_environ``), read in the worker (``WorkerEnv.from_environ`` in ``undying.init()``).

One type for both sides, so the variables' names, encodings and standalone defaults live in one
place. The launcher hands the agent three of them too (token, spec, injections).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from undying.config import JobSpec, spec_from_json

ENV_CONTROLLER = "UNDYING_CONTROLLER"  # host:port of the controller's HTTP endpoint
ENV_TOKEN = "UNDYING_TOKEN"  # the job's secret
ENV_JOB_ID = "UNDYING_JOB_ID"
ENV_GENERATION = "UNDYING_GENERATION"
ENV_NODE = "UNDYING_NODE"
ENV_RUN_DIR = "UNDYING_RUN_DIR"
ENV_SPEC = "UNDYING_SPEC"  # the validated job spec as JSON
ENV_INJECT = "UNDYING_INJECT"  # fault-injection specs, ";"-separated
ENV_RESTART_COUNT = "UNDYING_RESTART_COUNT"
ENV_STORE_PREFIX = "UNDYING_STORE_PREFIX"
ENV_JOINING = "UNDYING_JOINING"  # "1": this worker replaces a lost rank in a live job
# The generation's ranks in process-group order, comma-separated; empty: every rank of WORLD_SIZE.
# Set when a job restarts at the size an elastic shrink left it (fewer ranks than WORLD_SIZE).
ENV_MEMBERS = "UNDYING_MEMBERS"

# ``deterministic: true``: what the agent adds to each worker's environment, read by cuBLAS and NCCL
# when the worker first uses them. A fixed workspace makes cuBLAS's split reductions repeatable; NCCL's
# Ring algorithm with the Simple protocol on one channel count sums every element in the same order on
# every run (its tuner would otherwise pick Tree, LL/LL128 or NVLink SHARP by size and topology). 16
# channels is a middle value (fewer cost bandwidth); a user sets both NCCL_*_NCHANNELS to choose another.
DETERMINISTIC_NCCL_CHANNELS = "16"
DETERMINISTIC_ENV: dict[str, str] = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_MIN_NCHANNELS": DETERMINISTIC_NCCL_CHANNELS,
    "NCCL_MAX_NCHANNELS": DETERMINISTIC_NCCL_CHANNELS,
}
_CHANNEL_BOUNDS = ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")

STANDALONE_STORE_PREFIX = "undying/standalone"


def standalone_run_dir() -> Path:
    """A fresh run directory for a script started without ``undying run`` (plain ``python``), as
    ``undying run`` makes one without ``--run-dir``: a new run never picks up another run's checkpoints.
    ``UNDYING_RUN_DIR`` names one instead (to resume a plain run from its checkpoints)."""
    return Path("runs") / time.strftime(f"standalone-%Y%m%d-%H%M%S-{os.getpid()}")


@dataclass(frozen=True)
class WorkerEnv:
    """Everything a worker learns from its agent, with the defaults of a standalone run (a
    script started without ``undying run``: one rank, no controller, no store).

    The torchrun variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``TORCHELASTIC_RESTART_COUNT``) are written too, so scripts written for torchrun find them.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node: int = 0
    generation: int = 1
    restart_count: int = 0
    joining: bool = False  # a replacement for a lost rank: it receives its state from a live replica
    controller: str | None = None  # host:port of the controller's HTTP endpoint; None when standalone
    token: str = ""
    job_id: str | None = None  # None when standalone: no agent owns a node shared-memory directory
    run_dir: Path = field(default_factory=standalone_run_dir)
    spec: JobSpec = field(default_factory=JobSpec)
    injections_text: str = ""  # inject.decode reads it
    store_prefix: str = STANDALONE_STORE_PREFIX
    master_addr: str = ""  # the job's TCPStore (hosted by the controller)
    master_port: int = 0
    members: tuple[int, ...] = ()  # the generation's ranks in group order; empty: every rank of world_size

    @property
    def store_address(self) -> tuple[str, int] | None:
        """Where the job's store is; None for a standalone run (it uses an in-process store)."""
        if not self.controller:
            return None
        if not self.master_addr:
            raise ValueError(f"{ENV_CONTROLLER} is set but MASTER_ADDR is not: no store to join")
        return self.master_addr, self.master_port

    def to_environ(self, inherited: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables to add to the worker's inherited environment (``os.environ`` by default):
        with ``deterministic``, those of ``DETERMINISTIC_ENV`` it does not set already."""
        inherited = os.environ if inherited is None else inherited
        return {**self._contract(), **compile_cache_environ(self.spec.compile_cache),
                **deterministic_environ(self.spec.deterministic, inherited)}

    def _contract(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node),
            "ROLE_RANK": str(self.rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            ENV_CONTROLLER: self.controller or "",
            ENV_TOKEN: self.token,
            ENV_JOB_ID: self.job_id or "",
            ENV_GENERATION: str(self.generation),
            ENV_NODE: str(self.node),
            ENV_RUN_DIR: str(self.run_dir),
            ENV_SPEC: self.spec.model_dump_json(),
            ENV_INJECT: self.injections_text,
            ENV_RESTART_COUNT: str(self.restart_count),
            ENV_STORE_PREFIX: self.store_prefix,
            ENV_JOINING: "1" if self.joining else "0",
            ENV_MEMBERS: ",".join(str(rank) for rank in self.members),
        }

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read the contract (``os.environ`` by default); a variable that is absent takes its default."""
        env = os.environ if environ is None else environ
        return cls(
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            node=int(env.get(ENV_NODE, env.get("GROUP_RANK", "0"))),
            generation=int(env.get(ENV_GENERATION, "1")),
            restart_count=int(env.get(ENV_RESTART_COUNT, env.get("TORCHELASTIC_RESTART_COUNT", "0"))),
            joining=env.get(ENV_JOINING) == "1",
            controller=env.get(ENV_CONTROLLER) or None,
            token=env.get(ENV_TOKEN, ""),
            job_id=env.get(ENV_JOB_ID) or None,
            run_dir=Path(env[ENV_RUN_DIR]) if env.get(ENV_RUN_DIR) else standalone_run_dir(),
            spec=spec_from_json(env[ENV_SPEC]) if ENV_SPEC in env else JobSpec(),
            injections_text=env.get(ENV_INJECT, ""),
            store_prefix=env.get(ENV_STORE_PREFIX, STANDALONE_STORE_PREFIX),
            master_addr=env.get("MASTER_ADDR", ""),
            master_port=int(env.get("MASTER_PORT") or "0"),
            members=tuple(int(rank) for rank in env.get(ENV_MEMBERS, "").split(",") if rank.strip()),
        )


def worker_env_of_this_process(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """What ``undying.init()`` joins: the job its agent started this process in, or a one-rank
    standalone job (plain ``python``). A process given several ranks without an agent (torchrun's
    ``WORLD_SIZE``) is refused in one line: nothing would connect its ranks."""
    env = WorkerEnv.from_environ(environ)
    if env.controller is None and env.world_size != 1:
        raise ValueError(f"undying.init(): WORLD_SIZE={env.world_size} but this process was not started by "
                         f"`undying run` ({ENV_CONTROLLER} is not set; torchrun sets WORLD_SIZE too): a plain "
                         f"`python` run is one process; start {env.world_size} with `undying run "
                         f"--nproc-per-node {env.world_size} SCRIPT`")
    return env


def compile_cache_environ(compile_cache: str | None) -> dict[str, str]:
    """``compile_cache: DIR``: torch.compile's on-disk caches (Inductor's FX graphs and kernels,
    AOTAutograd's graphs, Triton's kernels; all under ``TORCHINDUCTOR_CACHE_DIR``) in DIR, so a
    replacement or restarted worker, a warm standby that becomes one, or the next job, reuses what
    an earlier process compiled instead of compiling again. Nothing set without it (torch's default,
    a directory under /tmp of this machine)."""
    if not compile_cache:
        return {}
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(compile_cache)}


def deterministic_environ(deterministic: bool, inherited: Mapping[str, str]) -> dict[str, str]:
    """``deterministic: true``: the variables of ``DETERMINISTIC_ENV`` that ``inherited`` lacks. A value
    the user set wins (and is what the checkpoints record); a user who set one NCCL channel bound gets
    the other at the same value, so the channel count stays fixed. Nothing without deterministic mode."""
    if not deterministic:
        return {}
    added = {name: value for name, value in DETERMINISTIC_ENV.items() if name not in inherited}
    user_bounds = [inherited[name] for name in _CHANNEL_BOUNDS if name in inherited]
    if len(user_bounds) == 1:
        added.update({name: user_bounds[0] for name in _CHANNEL_BOUNDS if name in added})
    return added
