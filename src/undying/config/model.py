"""The job spec's model: every knob of a run with its range, and the values derived from them.

Read in every process (the launcher/controller, the agent, the worker); each builds it through
``undying.config.loading`` and then only reads it. Knob names follow MindCluster.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from undying.config.errors import allowed_strategy_list, spec_rule
from undying.strategy_names import SPEC_STRATEGIES, StrategyName

# What recover_strategy may list. A Literal of the enum's members (pydantic accepts their string
# values) rather than the enum itself, so that job-restart, never listed, is an unknown strategy.
SpecStrategy = Literal[SPEC_STRATEGIES]  # type: ignore[valid-type]
STRATEGIES: tuple[StrategyName, ...] = SPEC_STRATEGIES
SNAPSHOT_INTERVAL_AUTO = "auto"  # checkpoint.snapshot_interval chosen as the job runs


def _reject_bool(value: Any) -> Any:
    # Pydantic's lax mode reads True as 1; in a spec that is always a typo.
    if isinstance(value, bool):
        raise PydanticCustomError("number_type", "Input should be a number, not a boolean")
    return value


def _on_off_from_bool(value: Any) -> Any:
    # YAML 1.1 reads bare on/off as booleans.
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


class CheckpointSpec(BaseModel):
    """Where and how often workers save. ``dir=None`` means ``RUN_DIR/checkpoints``; ``dir`` is a
    local or shared-filesystem path, or an fsspec URL (``s3://``, ``gs://``, ``file://``, chained
    ``simplecache::s3://``, ...) whose protocols fsspec knows; neither is reached here (the
    saver finds out whether it can write, and whether the protocol's package is installed).

    ``interval``: steps between T2 checkpoints (persisted in the background).
    ``snapshot_interval``: steps between T1 snapshots into node shared memory (0: only at
    T2 checkpoint steps; ``auto``, the default: chosen as the job runs so that snapshots cost at
    most ``snapshot_budget`` of the training time, every step until measured,
    runtime/snapshot_cadence.py; 1: every step, so a recovery from T1 recomputes no step). ``snapshot_budget``:
    that fraction, in (0, 1) (default 0.01); read only with ``auto``. ``snapshot_slots``: T1 slots per rank, each the size of the rank's
    snapshot (its part of a data-parallel replica kept once per node, checkpoint/node_replica.py); with 2, while the persister holds one the other is rewritten each time (a torn write
    falls back to the persisted step), with 3 a torn write falls back to the previous step.
    ``overlap``: ``on`` copies the parameters and optimizer state of a snapshot in the
    background, overlapping the next step's forward, backward and gradient sync (its optimizer
    step waits for the copy); ``off`` copies everything at the step boundary; ``auto`` (the
    default) is ``on`` for a device's (GPU's) state and ``off`` for CPU state, where the copy
    competes with training for the same cores (measured: no gain, docs/benchmarks.md).
    ``peer_copy``: ``auto`` (the default) also keeps each rank's T1 snapshot in the memory of the
    next node when no replica holds the rank's state (a pure-FSDP mesh, ``replicate=1``, on two or
    more nodes), so that a lost node's shards come back from memory (runtime/peer_copy.py);
    ``off`` keeps none (a lost node's shards then come from T2).
    ``persist``: ``true`` (the default) writes T2 every ``interval`` steps; every node must then write
    under one shared root, which the controller checks before it gives a node ranks (root_probe.py).
    ``false``: no periodic T2 (a snapshot into T1 every ``interval`` steps instead): a job that loses
    every node starts afresh; for nodes without shared storage."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dir: str | None = None
    interval: int = Field(100, ge=1)
    keep: int = Field(2, ge=1)
    snapshot_interval: int | Literal["auto"] = "auto"
    snapshot_budget: float = Field(0.01, gt=0, lt=1)
    snapshot_slots: int = Field(2, ge=2, le=8)
    overlap: Literal["auto", "on", "off"] = "auto"
    peer_copy: Literal["auto", "off"] = "auto"
    persist: bool = True

    _reject_bool_numbers = field_validator("interval", "keep", "snapshot_budget", "snapshot_slots",
                                           mode="before")(_reject_bool)
    _on_off_from_yaml_bool = field_validator("overlap", "peer_copy", mode="before")(_on_off_from_bool)

    @field_validator("snapshot_interval", mode="before")
    @classmethod
    def _count_or_auto(cls, value: Any) -> Any:
        # Checked here in full: pydantic's own errors for a union name each member, not the field.
        allowed = "an integer >= 0, or auto"
        if value == SNAPSHOT_INTERVAL_AUTO:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise spec_rule("not an integer or auto", allowed, value)
        if value < 0:
            raise spec_rule("out of range", allowed, value)
        return value

    @field_validator("dir")
    @classmethod
    def _known_url_protocols(cls, value: str | None) -> str | None:
        if value is None or "://" not in value:
            return value
        import fsspec  # only for URLs; a dependency of torch

        available = fsspec.available_protocols()
        # A chained URL ("simplecache::s3://bucket/ckpt") names one protocol per link.
        protocols = [link.split("://", 1)[0] for link in value.split("::")]
        unknown = [protocol for protocol in protocols if protocol not in available]
        if unknown:
            raise spec_rule(f"unknown fsspec protocol {unknown[0]!r}",
                            f"a local path, or a URL of a protocol fsspec knows: {', '.join(sorted(available))}",
                            value)
        return value


# A live agent beats this often (or twice per heartbeat_interval where that is more often), on a
# connection of its own: its node's sign of life, whatever its poll, its orders and its ranks do.
AGENT_BEAT_EVERY = 0.25
# This much later than an agent's beat was due, with the agent and every rank of its node silent at
# once, the host is frozen or cut off (bench/detection.py measures the longest silence of a whole
# node under load; docs/benchmarks.md).
HOST_SILENCE_SLACK = 0.6


class JobSpec(BaseModel):
    """One job's configuration, with every value in range and the cross-field rules holding:
    non-exit strategies need ``process_recover``, ``recover`` needs ``pod_rescheduling: on`` and a
    ``fault_scheduling`` other than ``off`` (so every strategy listed can run),
    ``heartbeat_timeout > heartbeat_interval`` and ``1 <= min_nodes <= nnodes``. It does not check
    that paths or URLs exist."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    process_recover: bool = False
    recover_strategy: list[SpecStrategy] = Field(default_factory=lambda: [StrategyName.EXIT])
    pod_rescheduling: Literal["on", "off"] = "off"
    fault_scheduling: Literal["force", "grace", "off"] = "force"
    grace_period: float = Field(900.0, gt=0)
    wait_reschedule_timeout: int = Field(270, ge=30, le=270)
    max_restarts: int = Field(32767, ge=0, le=32767)
    # Recoveries in a row that commit no step before the job stops as a crash loop (0: never).
    crash_loop_limit: int = Field(3, ge=0, le=32767)
    monitor_interval: float = Field(5.0, gt=0, le=300)
    comm_timeout: float = Field(30.0, gt=0)
    heartbeat_interval: float = Field(1.0, gt=0)
    heartbeat_timeout: float = Field(10.0, gt=0)
    # Seconds a node's agent and all its ranks may be silent together (while other nodes are heard)
    # before its host counts as frozen or cut off (None: an agent beat + HOST_SILENCE_SLACK, 0.85 s).
    # Raise it where network outages of about a second must pass without a recovery.
    host_silence_timeout: float | None = Field(None, gt=0)
    start_timeout: float = Field(300.0, gt=0)
    # Seconds a live rank may go without committing a step before it counts as hung (None: off).
    step_timeout: float | None = Field(None, gt=0)
    node_return_timeout: float = Field(120.0, gt=0)
    # Seconds a job asked to stop (SIGTERM, undying stop) has to persist its newest step before it is cancelled.
    stop_timeout: float = Field(120.0, gt=0)
    # Stragglers (controller/stragglers.py): a rank whose busy time per step (compute and data loading,
    # not the wait inside collectives), averaged over its last straggler_window steps, is at least
    # straggler_threshold times its peers' median is reported; switch: its node's ranks move to an
    # idle spare at a step boundary (needs process_recover). off: step times are not compared.
    straggler_strategy: Literal["off", "report", "switch"] = "report"
    straggler_threshold: float = Field(1.3, gt=1, le=100)
    straggler_window: int = Field(10, ge=2, le=1000)
    # Bad steps (runtime/step_check.py): a non-finite gradient norm or ft.check value fails the step on
    # every rank before the update, and so does a loss (ft.check(loss=...)) above loss_spike_factor
    # times its mean over the last loss_spike_window committed steps (None: no spike check). The step
    # is replayed from the committed state; a replay that is bad again is skipped (committed without
    # its update) or stops the job (bad_step_repeat); a clean replay (bad_step_transient) is reported,
    # or switches the node of the rank whose value was bad to a spare.
    bad_step_check: bool = True
    loss_spike_factor: float | None = Field(None, gt=1)
    loss_spike_window: int = Field(20, ge=2, le=100000)
    bad_step_repeat: Literal["skip", "stop"] = "stop"
    bad_step_transient: Literal["report", "switch"] = "report"
    # Health checks (agent/node_check.py): each agent checks its node before it is given ranks (its first
    # hello, a spare's adoption, after a job restart stopped its workers); a node that fails holds no ranks.
    node_check: bool = True
    watchdog: Literal["on", "off", "detect-only"] = "on"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    compile_cache: str | None = None
    warm_standby: bool = True  # each agent forks its workers from one interpreter with torch imported
    # Elastic training: how a replica covers a lost replica's share of the global batch. grow (the
    # default): one larger batch per step, so any loop (one next(loader) per step) runs on unchanged,
    # at the cost of memory per forward/backward growing by the lost replicas' share (2x after losing
    # half). accumulate: one micro-batch per slot, same memory; the loop iterates loader.step_batches().
    elastic_batch: Literal["accumulate", "grow"] = "grow"
    # Every rank appends the sample indices of each committed step to RUN_DIR/samples/ (audits, tests).
    sample_log: bool = False
    # At the end (ft.finish) every rank's worker_done event carries SHA-256 digests of its parameters
    # and buffers, its optimizer state (its own shards in a sharded job) and its torch RNG state, so
    # that every rank of two runs can be compared (tests, audits; costs one pass over the state).
    state_digests: bool = False
    # Fixed reduction orders on GPU (torch deterministic algorithms, cuDNN without autotuning, a fixed
    # cuBLAS workspace, NCCL Ring/Simple on a fixed channel count, no NVLS), at a cost in speed; a user
    # op without a deterministic kernel then raises. Off: replays are bitwise equal on CPU/gloo only.
    deterministic: bool = False
    nnodes: int = Field(1, ge=1)
    min_nodes: int | None = None
    nproc_per_node: int = Field(1, ge=1)

    _reject_bool_numbers = field_validator(
        "grace_period",
        "wait_reschedule_timeout",
        "max_restarts",
        "crash_loop_limit",
        "monitor_interval",
        "comm_timeout",
        "heartbeat_interval",
        "heartbeat_timeout",
        "host_silence_timeout",
        "start_timeout",
        "step_timeout",
        "node_return_timeout",
        "stop_timeout",
        "straggler_threshold",
        "straggler_window",
        "loss_spike_factor",
        "loss_spike_window",
        "nnodes",
        "min_nodes",
        "nproc_per_node",
        mode="before",
    )(_reject_bool)
    _on_off_from_yaml_bool = field_validator("pod_rescheduling", "watchdog", "straggler_strategy",
                                             mode="before")(_on_off_from_bool)

    @field_validator("fault_scheduling", mode="before")
    @classmethod
    def _off_from_yaml_false(cls, value: Any) -> Any:
        return "off" if value is False else value

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _null_checkpoint_means_defaults(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("recover_strategy", mode="before")
    @classmethod
    def _split_comma_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",")] if value.strip() else []
        return value

    @field_validator("recover_strategy")
    @classmethod
    def _non_empty_without_duplicates(cls, strategies: list[StrategyName]) -> list[StrategyName]:
        if not strategies:
            raise spec_rule("empty list", allowed_strategy_list(), strategies)
        seen: set[str] = set()
        for index, name in enumerate(strategies):
            if name in seen:
                raise spec_rule(
                    "duplicate strategy",
                    "each strategy at most once",
                    str(name),  # the user's spelling in the message, not the enum's repr
                    field=f"recover_strategy[{index}]",
                )
            seen.add(name)
        return strategies

    @model_validator(mode="after")
    def _cross_field_rules(self) -> JobSpec:
        if not self.process_recover and self.process_level_strategies():
            raise spec_rule(
                "needs process_recover: true",
                "exit alone, or process_recover: true",
                [str(name) for name in self.recover_strategy],
                field="recover_strategy",
            )
        if StrategyName.RECOVER in self.recover_strategy and self.pod_rescheduling != "on":
            raise spec_rule(
                "recover (in recover_strategy) needs pod_rescheduling: on",
                "on, or recover_strategy without recover",
                self.pod_rescheduling,
                field="pod_rescheduling",
            )
        if StrategyName.RECOVER in self.recover_strategy and self.fault_scheduling == "off":
            raise spec_rule(
                "recover (in recover_strategy) reschedules a lost node, which fault_scheduling: off forbids",
                "force or grace, or recover_strategy without recover",
                self.fault_scheduling,
                field="fault_scheduling",
            )
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise spec_rule(
                "must be greater than heartbeat_interval",
                f"> heartbeat_interval ({self.heartbeat_interval})",
                self.heartbeat_timeout,
                field="heartbeat_timeout",
            )
        if self.host_silence_timeout is not None and self.host_silence_timeout <= self.agent_beat_interval():
            raise spec_rule(
                "must be greater than the agents' beat interval (a live host is silent that long between beats)",
                f"> {self.agent_beat_interval():g} (0.25, or heartbeat_interval / 2 if shorter), or null",
                self.host_silence_timeout,
                field="host_silence_timeout",
            )
        for field, value in (("straggler_strategy", self.straggler_strategy),
                             ("bad_step_transient", self.bad_step_transient)):
            if value == "switch" and not self.process_recover:
                raise spec_rule("switch moves a node's ranks to a spare in a process-level recovery, "
                                "which needs process_recover: true", "report, or process_recover: true",
                                value, field=field)
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise spec_rule("out of range", f"1..{self.nnodes} (nnodes)", self.min_nodes, field="min_nodes")
        return self

    @property
    def world_size(self) -> int:
        """Number of worker processes when every node is present."""
        return self.nnodes * self.nproc_per_node

    @property
    def fewest_nodes(self) -> int:
        """The fewest nodes elastic training may shrink to (``min_nodes``, else 1)."""
        return self.min_nodes if self.min_nodes is not None else 1

    def agent_beat_interval(self) -> float:
        """Seconds between two beats of a live agent: ``AGENT_BEAT_EVERY``, or half of
        ``heartbeat_interval`` where that is shorter."""
        return min(AGENT_BEAT_EVERY, self.heartbeat_interval / 2)

    def host_silence_limit(self) -> float:
        """Seconds of silence from a node's agent and every rank of it after which the controller
        takes the host for frozen or cut off (while another node is heard from): ``host_silence_timeout``,
        by default one agent beat interval plus ``HOST_SILENCE_SLACK``; never more than
        ``heartbeat_timeout``. A worker's fence before it applies a step (its lease) is half of this."""
        chosen = self.host_silence_timeout
        return min(self.heartbeat_timeout, chosen if chosen is not None else self.agent_beat_interval() + HOST_SILENCE_SLACK)

    def commit_fence_lease(self) -> float | None:
        """Seconds a worker's newest answered heartbeat stays good for its fence before it applies a
        step: half of ``host_silence_limit()``, so that a rank the controller could have taken for
        silent asks first. None unless ``watchdog`` is ``on`` (no fence then)."""
        return self.host_silence_limit() / 2 if self.watchdog == "on" else None

    def reschedule_wait(self) -> float:
        """Seconds to wait for a lost node to come back before elastic training shrinks the job:
        ``wait_reschedule_timeout``. The controller reads the wait only here, so fault tests can
        shorten it below the 30 s floor in the controller's process (tests/short_reschedule.py)."""
        return float(self.wait_reschedule_timeout)

    def process_level_strategies(self) -> list[StrategyName]:
        """The listed strategies other than ``exit``, in the order they are to be tried."""
        return [name for name in self.recover_strategy if name != StrategyName.EXIT]
