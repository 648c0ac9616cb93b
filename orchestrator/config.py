"""The run configuration: one pydantic tree, loaded from YAML once at the edge and validated there.

Policies never see these models; the driver and the actors unpack them into plain arguments.
Every field says what it means and its unit; errors name the field and the fix in one line.
The reference, with the reasoning and measurements behind the settings, is docs/config.md.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from islands.data_defaults import HELDOUT_FRACTION, SHUFFLE_DOCUMENTS
from islands.spec import ModelConfig, model_config
from orchestrator.config_errors import format_validation_error, printable
from policies.network import SCENARIOS as NETWORK_SCENARIOS
from policies.sync_schedule import check_schedule_pairs, check_sync_every

# The merge, adoption and compression policies do tensor math: their names are checked by importing
# them inside the validators, so that importing this module (the CLI, the health monitor's process)
# does not import torch.

MODES = ("decoupled", "sync-diloco", "streaming-diloco")
# The mode `diloco baseline-dp` writes into its run's config.yaml: not an engine mode (RunConfig refuses
# it), named here so that the baseline and the readers of run directories share one spelling.
DATA_PARALLEL_MODE = "data-parallel"

# What `mode: sync-diloco` means (docs/architecture.md section 3): K = all islands, unbounded grace, uniform
# weights, mean merge, P = 1, overwrite adoption, and islands wait for each round.
SYNC_DILOCO_OUTER = {
    "min_quorum": "all",
    "grace_gamma": math.inf,
    "grace_cap_s": math.inf,
    "weighting": "uniform",
    "merge_rule": "mean",
    "num_fragments": 1,
    "adoption": "overwrite",
    "wait_for_round": True,
}

# Streaming DiLoCo (Douillard et al., 2025): synchronous DiLoCo over P fragments submitted in turn,
# so each sync moves 1/P of the parameters. Same as sync-diloco except P is the user's (default 2).
STREAMING_DILOCO_OUTER = {k: v for k, v in SYNC_DILOCO_OUTER.items() if k != "num_fragments"}

# Outer settings each preset mode fixes; an explicit conflicting value in outer: is an error.
MODE_PRESETS: dict[str, dict[str, Any]] = {
    "decoupled": {},
    "sync-diloco": SYNC_DILOCO_OUTER,
    "streaming-diloco": STREAMING_DILOCO_OUTER,
}


class ConfigError(ValueError):
    """A configuration problem, stated in one line with the field and the fix."""


TRACKERS = ("mlflow", "tensorboard", "wandb")
"""The experiment trackers `run.trackers` names (orchestrator/run/trackers.py)."""
TRACKER_FORMS = "mlflow, mlflow:TRACKING_URI, tensorboard, tensorboard:DIR, wandb or wandb:PROJECT"


def tracker_spec(entry: str) -> tuple[str, str | None]:
    """A `run.trackers` entry as (tracker, its argument or None): "mlflow:http://host:5000" -> ("mlflow",
    "http://host:5000"). Raises ValueError (one line, naming the entry and the forms taken) for anything else."""
    name, sep, arg = entry.partition(":")
    if name not in TRACKERS or (sep and not arg.strip()):
        raise ValueError(f"unknown tracker {printable(repr(entry))}; use {TRACKER_FORMS}")
    return name, arg if sep else None


INT64 = 1 << 63
"""Whole numbers of the config are below this in size: they reach numpy, torch and Ray as 64-bit integers."""


def _boolean_number(annotation: Any, v: Any) -> bool:
    """Whether `v` is a bool where `annotation` takes a number (int or float, alone or in a union), at any depth
    of its dicts, lists and tuples (pool resources, sync_every_schedule's pairs)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _boolean_number(args[0], v)
    if isinstance(v, bool):
        members = args if origin in (Union, types.UnionType) else (annotation,)
        return bool({int, float} & set(members)) and bool not in members
    if origin is dict and len(args) == 2 and isinstance(v, dict):
        return any(_boolean_number(args[1], x) for x in v.values())
    if origin is list and len(args) == 1 and isinstance(v, (list, tuple)):
        return any(_boolean_number(args[0], x) for x in v)
    if origin is tuple and isinstance(v, (list, tuple)) and len(args) == len(v):
        return any(_boolean_number(a, x) for a, x in zip(args, v))
    return False


class _Section(BaseModel):
    # Numbers are finite (a field that takes inf says so: allow_inf_nan=True), never booleans, and whole
    # numbers fit in 64 bits; the fuzz test (tests/engine/test_config_fuzz.py) holds every field to it.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic reads True as 1: `--set outer.num_fragments=yes` would train with one fragment.
        if isinstance(v, (bool, dict, list, tuple)) and info.field_name is not None and _boolean_number(
                cls.model_fields[info.field_name].annotation, v):
            got = v if isinstance(v, bool) else f"a boolean in {v!r}"
            raise ValueError(f"Input should be a number, got {got} (YAML reads true, yes and on as a boolean); write "
                             f"the number itself")
        return v

    @field_validator("*")
    @classmethod
    def _within_int64(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and not -INT64 <= v < INT64:
            raise ValueError(f"Input should be less than 2**63 in size (a 64-bit integer), got {v}; write a smaller number")
        return v


class ModelSection(_Section):
    """Which model every island trains: the built-in byte transformer (a preset), or the user's own."""

    factory: str | None = Field(None, description="Import path 'package.module:function' of a zero-argument function "
                                "returning the torch.nn.Module to train; None = the built-in byte transformer (preset).")
    loss: str | None = Field(None, description="Import path of loss(model, batch) -> scalar tensor; None = Hugging Face "
                             "style outputs.loss for dict batches with labels, else cross-entropy of the logits.")
    optimizer: str | None = Field(None, description="Import path of optimizer(parameters) -> torch.optim.Optimizer, the "
                                  "inner optimizer; None = AdamW with the inner section's settings.")
    preset: str = Field("tiny", description="Model size preset from islands.model.PRESETS (nano, tiny, small, 50m).")
    seq_len: int | None = Field(None, gt=0, description="Override the preset's context length in tokens (also the "
                                "training window of a token corpus for a user's model).")
    d_model: int | None = Field(None, gt=0, description="Override the preset's hidden size.")
    n_layers: int | None = Field(None, gt=0, description="Override the preset's number of transformer blocks.")
    n_heads: int | None = Field(None, gt=0, description="Override the preset's number of attention heads.")

    def overrides(self) -> dict[str, int]:
        """The non-empty overrides, as keyword arguments for islands.model.model_config."""
        return {k: v for k, v in self.model_dump(exclude={"preset", "factory", "loss", "optimizer"}).items()
                if v is not None}

    def shape(self) -> ModelConfig:
        """The model's shape: the preset with the non-empty overrides applied (islands.spec.model_config)."""
        return model_config(self.preset, **self.overrides())


class DataSection(_Section):
    """Where the training text comes from and how islands read it (docs/data.md)."""

    source: Literal["stdlib", "parquet", "tokens", "python"] = Field(
        "stdlib", description="'stdlib': the standard library's source (no download); 'parquet': Parquet/Arrow files at `path`; "
        "'tokens': flat uint16/uint32 token files at `path`; 'python': datasets passed to the Python API."
    )
    path: str | None = Field(None, description="The corpus for source parquet or tokens: a file or a directory of files, a local "
                             "path or a pyarrow.fs URI (s3://bucket/prefix, gs://...). A pool's data_path overrides it.")
    text_column: str | None = Field(None, description="String column to train on (UTF-8 bytes), for source=parquet.")
    token_column: str | None = Field(None, description="list<int> column of token ids, for source=parquet.")
    token_dtype: Literal["uint16", "uint32"] = Field("uint16", description="Width of the little-endian ids in token files "
                                                      "(source=tokens): uint16 for vocabularies up to 65,536.")
    tokenizer: str = Field("bytes", description="Text to token ids: 'bytes' (vocab 256), 'train' (BPE trained on a sample of the "
                           "training split), a tokenizer.json path, or 'module:function' (str -> list[int]).")
    vocab_size: int | None = Field(None, gt=0, description="Ids are below this: tokenizer 'train''s vocabulary (null: 4096), a "
                                   "function tokenizer's, a token_column's (null: its largest id + 1 from the Parquet "
                                   "statistics) or a token file's (required).")
    heldout_fraction: float = Field(HELDOUT_FRACTION, gt=0, lt=0.5, description="Fraction of files (stdlib), rows (parquet) or units "
                                    "(tokens) held out for evaluation.")
    max_bytes: int | None = Field(None, gt=0, description="Cap on training bytes of the stdlib corpus (keeps tests small); None = all.")
    shuffle_documents: bool = Field(
        SHUFFLE_DOCUMENTS, description="Units, rows and windows in seeded orders, so each island reads a representative sample; false "
        "keeps source order (islands then see different, non-IID data).")
    batch_size: int = Field(16, gt=0, description="Sequences per inner step per island.")
    unit_tokens: int = Field(1 << 20, gt=0, description="Tokens per unit of a token file (source=tokens) or of a token array "
                             "from Python: the piece an island reads at once.")
    unit_examples: int = Field(1024, gt=0, description="Examples per unit of a map-style dataset from Python (a Ray Data "
                               "dataset's units are its blocks).")
    block_batches: int = Field(512, gt=0, description="Batches per shuffle block: an island shuffles its windows in blocks of "
                               "block_batches * batch_size windows (its read buffer).")
    readahead_units: int = Field(2, ge=0, description="Units an island reads ahead of the one it trains on, on a thread of "
                                 "its own (bounded memory: these units' ids).")
    heldout_tokens: int = Field(1 << 20, gt=0, description="Most held-out tokens evaluation reads (from the held-out units, in "
                                "order): the evaluation windows are spread over them.")
    tokenizer_sample_bytes: int = Field(64 << 20, gt=0, description="Text the driver reads from the training units to train a "
                                        "tokenizer (tokenizer: train); the only training text it ever reads.")

    @model_validator(mode="after")
    def _source_needs_path(self) -> DataSection:
        if self.source in ("parquet", "tokens") and not self.path:
            example = "/path/to/data.parquet" if self.source == "parquet" else "/path/to/train.bin"
            raise ValueError(f"data.path is required when data.source is '{self.source}'; set data.path={example}")
        # A setting the source does not read (data.path under stdlib, ...) is refused by the config's rules of
        # settings that have no effect (INERT_RULES, below), with the others of its kind.
        if self.source == "parquet" and (self.text_column is None) == (self.token_column is None):
            raise ValueError("set exactly one of data.text_column or data.token_column for a parquet source")
        if self.source == "tokens":
            if self.vocab_size is None:
                raise ValueError("data.vocab_size is required for token files (source=tokens): set it to the vocabulary of the "
                                 "tokenizer that wrote them, e.g. data.vocab_size=50257")
        return self


class InnerSection(_Section):
    """The inner optimizer each island runs on its own shard (AdamW)."""

    lr: float = Field(3e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW decoupled weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.99, ge=0, lt=1, description="AdamW beta2.")
    warmup_steps: int = Field(20, ge=0, description="Linear learning-rate warmup, in inner steps.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warmup: 'constant' keeps lr; 'cosine' decays it to lr * lr_final_ratio at the "
        "token budget, following the run's global progress (policies/lr_schedule.py).")
    lr_final_ratio: float = Field(0.1, ge=0, le=1, description="Under lr_schedule 'cosine': the rate at the token "
                                  "budget as a fraction of lr.")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the gradient norm to this; None disables clipping.")
    torch_threads: int = Field(1, gt=0, description="torch intra-op threads per island worker.")
    precision: Literal["fp32", "tf32", "bf16"] = Field(
        "fp32", description="Inner-step arithmetic (islands and data parallel): 'fp32'; 'tf32' = TF32 GPU matmuls; "
        "'bf16' = forward pass under bfloat16 autocast. Weights, optimizer state and what islands send stay fp32.")


def _recorded_plugin(spec: str, info: ValidationInfo) -> bool:
    """Whether `spec` is a plug-in's import path in a config read back from a run directory: the run loaded it
    when it started, and a reader of its results (``diloco report``) need not have the user's package."""
    return isinstance(spec, str) and ":" in spec and bool((info.context or {}).get("recorded"))


class OuterSection(_Section):
    """The outer optimizer: quorum, grace, weighting, merge, outer step, staleness, adoption, wire format.

    Fields come in groups: the settings every run sets first, then the tuning of rounds that merge fewer
    than all islands (on by default), the wire format, and the experiments (off by default).
    Why each is so, and what it measured: docs/config.md.
    """

    num_fragments: int = Field(2, ge=1, description="P: fragments the parameters are split into (size-balanced).")
    sync_every_steps: int = Field(40, ge=1, description="H: inner steps between two submissions of the same fragment.")
    min_quorum: int | Literal["all"] = Field(1, description="K: submissions a round waits for; 'all' = every island.")
    grace_gamma: float = Field(0.5, ge=0, allow_inf_nan=True, description="gamma in grace = clamp(gamma*(tau*t_step - t_quorum - t_sync), 0, cap); "
                               "inf = wait for all live islands.")
    grace_cap_s: float = Field(2.0, ge=0, allow_inf_nan=True, description="Upper bound of the grace window, seconds (inf allowed).")
    tau_steps: float | None = Field(None, gt=0, description="tau: inner steps a submission may be in flight; "
                                      "None = H/P (H as sync_every_schedule has it at the time).")
    weighting: Literal["tokens", "uniform"] = Field("tokens", description="'tokens': w = tokens*tokens/steps; 'uniform'.")
    merge_rule: str = Field("rda", description="'rda' (radial-directional, mean for embeddings), 'mean', or a user's "
                            "MergeRule by import path 'package.module:Name' (docs/outer.md).")
    lr: float = Field(0.7, gt=0, description="Outer SGD learning rate; unset with one island: 1.0 (policies/outer_regime.py).")
    momentum: float = Field(0.9, ge=0, lt=1, description="Outer Nesterov momentum; 0 = plain SGD; unset with one island: 0 "
                            "(policies/outer_regime.py).")
    optimizer: str | None = Field(None, description="Import path of optimizer(params) -> torch.optim.Optimizer, each "
                                  "fragment's outer step (docs/outer.md); None = Nesterov SGD with lr and momentum.")
    max_staleness: int = Field(4, ge=0, description="Refuse submissions whose base is more than this many versions old; "
                               "costs no memory (only version numbers are kept).")
    adoption: str = Field("rebase", description="How islands adopt a new fragment: 'rebase' keeps their progress not yet "
                          "merged; 'overwrite' replaces it (the paper); 'mix(alpha)' keeps alpha of it.")
    wait_for_round: bool = Field(False, description="Islands block after each submission until its round is adopted (synchronous DiLoCo).")
    torch_threads: int = Field(1, gt=0, description="torch intra-op threads of the outer optimizer's merges; it reserves no CPU, "
                               "so raise it only where its node has cores to spare (docs/outer.md).")

    # Rounds that merge fewer than all live islands (K < all): on by default, measured (docs/config.md).
    step_scale: Literal["clock", "participation", "none"] = Field(
        "clock", description="How a round merging a share s < 1 of the live islands counts: 'clock' = s of a full "
        "round in time; 'participation' = its outer gradient scaled by s; 'none' = unscaled.")
    partial_momentum: float | None = Field(
        0.7, ge=0, lt=1, description="Outer momentum of rounds that merge fewer than all live islands, under "
        "step_scale 'clock'; capped at momentum; None = momentum.")
    rda_across_rounds: bool = Field(
        True, description="Lengthen a partial round's merged outer gradient by RDA's norm rule over the fragment's "
        "recent rounds, capped at 1/sqrt(s); none under merge 'mean' or step_scale 'none'. Costs a float32 model copy.")

    # Wire format: how outer gradients go up and published fragments come down (docs/config.md).
    compression: str = Field("none", description="Uplink wire format: none (float32) | bf16 | int8 | int4 | int2 | sign | "
                             "topk (these three owe what they drop to the next submission) | 'package.module:Name'.")
    compression_block_size: int = Field(256, gt=0, description="Elements per quantization scale block (uplink and downlink; "
        "topk uses chunks of 4,096).")
    topk_density: float = Field(1 / 64, gt=0, le=1, description="Fraction of each 4,096-element chunk that topk keeps, "
        "uplink (outer.compression) and downlink (outer.downlink_delta) alike: about 2 x density bytes per parameter.")
    downlink: Literal["none", "bf16", "int8"] = Field(
        "none", description="Wire format of published fragments going down to islands: none (float32) | bf16 | int8 "
        "(per-block scales); the outer optimizer keeps float32.")
    downlink_delta: Literal["bf16", "int8", "int4", "int2", "sign", "topk"] | None = Field(
        None, description="Send a new version of a fragment as its difference from the island's copy, in this format; "
        "a first send goes whole in `downlink`; null = all whole. Costs N + 4 float32 model copies on the outer.")

    # Experimental: off by default (docs/config.md).
    sync_every_schedule: list[tuple[float, int]] = Field(
        default_factory=list, description="Experimental: H over the run as [until_fraction, H] pairs of the token "
        "budget, sync_every_steps after the last, e.g. [[0.1, 40]]. Empty = sync_every_steps throughout.")
    publish_to: Literal["all", "participants"] = Field(
        "all", description="Experimental: which islands a new fragment version goes to: 'all' live islands, or only "
        "the round's 'participants' (then keep max_staleness >= the number of islands).")
    feedback_decay: float = Field(1.0, ge=0, le=1, description="Experimental: under int2, sign and topk, the factor on "
        "what an island still owes each time new progress is added; 1 keeps all of it owed.")
    staleness_discount: float = Field(0.0, ge=0, description="Experimental: weight multiplier (1+staleness)^-d; 0 disables.")
    poison_guard: bool = Field(False, description="Experimental: refuse an outer gradient far out of line with the other "
                               "islands' recent ones (size, direction; from 3 islands on) or from a stale base (a digest), as a counted refusal.")
    poison_restart_after: int = Field(3, ge=0, description="Experimental, with poison_guard: restart an island from "
                                      "the global parameters after this many poison refusals in a row, or at one far "
                                      "out of line (0: never; an acceptance resets the count).")

    @field_validator("merge_rule")
    @classmethod
    def _merge_rule(cls, v: str, info: ValidationInfo) -> str:
        from islands.plugins import load_merge_rule

        if not _recorded_plugin(v, info):
            load_merge_rule(v)  # a registered name or an import path; else one line naming what exists and the fix
        return v.strip()

    @field_validator("adoption")
    @classmethod
    def _adoption(cls, v: str) -> str:
        from policies.adoption import parse_adoption

        parse_adoption(v)  # raises a one-line ValueError naming the valid forms
        return v

    @field_validator("compression")
    @classmethod
    def _compression(cls, v: str, info: ValidationInfo) -> str:
        from islands.plugins import load_compressor

        if not _recorded_plugin(v, info):
            load_compressor(v)  # a registered name or an import path; else one line naming what exists and the fix
        return v.strip()

    @field_validator("sync_every_schedule", mode="before")
    @classmethod
    def _schedule_pairs(cls, v: Any) -> Any:
        check_schedule_pairs(v)  # before pydantic's tuple check, whose "Field required" would not say what a pair is
        return v

    @field_validator("min_quorum")
    @classmethod
    def _quorum(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"min_quorum must be >= 1 or 'all', got {v}")
        return v

    @model_validator(mode="after")
    def _fragments_divide_h(self) -> OuterSection:
        # Fragments are submitted round-robin every H/P steps, so P must divide H (as torchft checks).
        check_sync_every(self.sync_every_steps, self.sync_every_schedule, self.num_fragments)
        return self

    def effective_tau_steps(self) -> float:
        """tau for the grace window: the configured value, or H/P (the gap until the island's next submission)."""
        return self.tau_steps if self.tau_steps is not None else self.sync_every_steps / self.num_fragments

    def tau_schedule(self) -> tuple[tuple[float, int], ...]:
        """tau over the run when it follows `sync_every_schedule` (H/P in each phase); empty when tau_steps is set."""
        if self.tau_steps is not None:
            return ()
        return tuple((float(until), h // self.num_fragments) for until, h in self.sync_every_schedule)


class PoolConfig(_Section):
    """A named set of nodes of one hardware kind in one region, and the islands placed on it."""

    name: str = Field(..., min_length=1, description="Pool name, e.g. 'us-east/v5p'; used in logs and reports.")
    islands: int = Field(1, ge=1, description="Island slots (learner units) on this pool; written {min: A, max: B} the pool "
                         "is elastic: B slots, of which the run needs A placed to start and fills the rest as nodes join.")
    min_islands: int | None = Field(None, ge=0, description="Elastic pool: islands that must be placed before the run starts "
                                    "(the 'min' of islands: {min, max}); None = a fixed pool of `islands`.")
    labels: dict[str, str] = Field(default_factory=dict, description="Node labels every bundle must match (bundle_label_selector), e.g. {pool: a}.")
    resources: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict, description="Custom resources every bundle asks for, e.g. {pool_a: 1}.")
    cpus_per_island: float = Field(1.0, gt=0, description="Logical CPUs reserved per island worker bundle.")
    region: str = Field("local", description="Region name for reports and the network model (network.scenario).")
    accelerator: str = Field("cpu", description="Hardware kind of this pool's nodes, e.g. 'cpu', 'H100', 'v5p'; islands use CUDA when it is not 'cpu'.")
    workers_per_island: int = Field(1, ge=1, description="Workers per island, data-parallel inside the island (gloo on CPU, NCCL on GPU); one failure domain.")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs reserved per worker bundle (0 on CPU pools).")
    shard: Literal["none", "fsdp"] = Field(
        "none", description="How an island's workers split the model: 'none' = each holds it whole (data parallel); "
        "'fsdp' = each holds 1/W of parameters and AdamW state (torch FSDP2); needs workers_per_island > 1.")
    precision: Literal["fp32", "tf32", "bf16"] | None = Field(
        None, description="This pool's inner-step arithmetic, overriding inner.precision (e.g. bf16 on an H100 pool, "
        "fp32 on an older generation without bf16 units); None follows inner.precision.")
    data_path: str | None = Field(None, description="This pool's own copy of the corpus (the same files, e.g. in its region's "
                                  "bucket); its islands read it instead of data.path, so training data never crosses regions.")
    emulated_slowdown: float = Field(1.0, ge=1.0, description="EMULATION: stretch each inner step to this multiple of its compute time (sleep).")
    emulated_jitter: float = Field(0.0, ge=0.0, lt=1.0, description="EMULATION: random +- fraction on the stretched step time.")

    @model_validator(mode="before")
    @classmethod
    def _island_range(cls, data: Any) -> Any:
        # `islands: {min: A, max: B}` is the user's spelling of an elastic pool; it is kept as two plain fields so
        # that everything sized by slots (data plan, specs, metrics) reads `islands` as before.
        if not isinstance(data, dict) or not isinstance(data.get("islands"), dict):
            return data
        rng, name = dict(data["islands"]), data.get("name", "?")
        if set(rng) != {"min", "max"}:
            raise ValueError(f"pool {name!r}: islands {rng} must be a number or {{min: A, max: B}}, "
                             f"e.g. islands: {{min: 2, max: 6}}")
        lo, hi = rng["min"], rng["max"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 0 <= lo <= hi or hi < 1:
            raise ValueError(f"pool {name!r}: islands {{min: {lo!r}, max: {hi!r}}} needs whole numbers 0 <= min <= max, "
                             f"max >= 1; e.g. islands: {{min: 2, max: 6}}")
        if data.get("min_islands") is not None and data["min_islands"] != lo:
            raise ValueError(f"pool {name!r}: islands.min {lo} conflicts with min_islands {data['min_islands']!r}; give one")
        return {**data, "islands": hi, "min_islands": lo}

    @model_validator(mode="after")
    def _gpu_pools_reserve_gpus(self) -> PoolConfig:
        if self.min_islands is not None and self.min_islands > self.islands:
            raise ValueError(f"pool {self.name!r}: min_islands {self.min_islands} exceeds islands {self.islands}; "
                             f"write islands: {{min: A, max: B}} with A <= B")
        # Caught here rather than when the island first touches CUDA, minutes in, on a placement group
        # that holds no GPU.
        if self.accelerator != "cpu" and self.gpus_per_worker <= 0:
            raise ValueError(f"pool {self.name!r}: accelerator {self.accelerator!r} trains on a GPU but gpus_per_worker "
                             f"is 0; set gpus_per_worker (e.g. 1) or accelerator: cpu")
        # NCCL (2.5 and later) refuses two ranks of one group on one GPU ("Duplicate GPU detected"), and a
        # fraction lets Ray pack an island's workers onto one card: fail here, not at the island's first start.
        if self.accelerator != "cpu" and self.workers_per_island > 1 and self.gpus_per_worker < 1:
            raise ValueError(f"pool {self.name!r}: {self.workers_per_island} workers per island on GPUs need a whole "
                             f"GPU each (NCCL refuses two ranks on one card), but gpus_per_worker is "
                             f"{self.gpus_per_worker:g}; set gpus_per_worker: 1 or workers_per_island: 1")
        if self.shard == "fsdp" and self.workers_per_island < 2:
            raise ValueError(f"pool {self.name!r}: shard 'fsdp' splits an island's model over its workers, but "
                             f"workers_per_island is {self.workers_per_island}; set workers_per_island: 2 or more, or shard: none")
        return self

    @property
    def emulated(self) -> bool:
        """True when this pool's speed is emulated by throttling (report it as emulation)."""
        return self.emulated_slowdown != 1.0 or self.emulated_jitter > 0

    @property
    def elastic(self) -> bool:
        """True when the pool's island count follows its capacity (islands: {min, max} with min < max)."""
        return self.min_islands is not None and self.min_islands < self.islands

    @property
    def required_islands(self) -> int:
        """Islands that must be placed before the run starts: `min_islands`, or every slot of a fixed pool."""
        return self.islands if self.min_islands is None else self.min_islands

    @property
    def spares(self) -> bool:
        """Whether the pool may hold warm spares: single-worker islands of a fixed pool (an elastic pool's free
        capacity goes to its vacant slots, which a spare would only compete with)."""
        return self.workers_per_island == 1 and not self.elastic

    def reserved_bundles(self, warm_spares: int) -> int:
        """Worker bundles this pool holds at once when it starts: one per worker of every required island, plus
        `warm_spares` when it may hold spares (`spares`)."""
        return self.required_islands * self.workers_per_island + (warm_spares if self.spares else 0)


class EvalSection(_Section):
    """Periodic evaluation of the global parameters on held-out data."""

    interval_s: float = Field(20.0, gt=0, description="Seconds between evaluations of the global parameters.")
    batches: int = Field(8, ge=1, description="Held-out batches per evaluation (fixed, evenly spaced windows).")
    batch_size: int = Field(16, ge=1, description="Sequences per held-out batch.")


class ChaosSection(_Section):
    """Chaos engineering: which faults to inject (policies.chaos). Default: none."""

    mode: Literal["none", "tape", "poisson", "fixed"] = Field("none", description="none | tape (YAML file) | poisson | fixed.")
    horizon_s: float = Field(180.0, gt=0, description="poisson: faults are drawn over (start_s, horizon_s) seconds of the run "
                             "(fixed spreads its faults over the token budget instead).")
    params: dict[str, Any] = Field(default_factory=dict, description="The mode's parameters, e.g. {mtbf_s: 60, seed: 3} or {path: tape.yaml}.")

    def spec(self) -> dict[str, Any]:
        """The dict policies.chaos.tape_from_config takes."""
        return {"mode": self.mode, **self.params}


class HealthSection(_Section):
    """How the health monitor judges islands and restarts them (policies.health, policies.restart)."""

    hang_factor: float = Field(20.0, gt=0, description="An island is hung after this many of its own step times without progress.")
    hang_floor_s: float = Field(5.0, gt=0, description="Never call an island hung sooner than this, seconds.")
    startup_s: float = Field(60.0, gt=0, description="Grace for an island's first step, seconds.")
    unreachable_s: float = Field(10.0, gt=0, description="Status calls failing this long make an island unreachable.")
    backoff_base_s: float = Field(0.5, gt=0, description="First restart delay; doubles per consecutive failure.")
    backoff_cap_s: float = Field(30.0, gt=0, description="Longest restart delay, seconds.")
    reset_after_s: float = Field(60.0, gt=0, description="Healthy this long resets an island's backoff.")
    reset_on_submission: bool = Field(True, description="A restarted island that cuts a submission resets its backoff at once: "
                                      "failures with work between them are not a crash loop.")
    max_restarts: int | None = Field(None, ge=0, description="Give up on an island slot after this many restarts (None = never).")
    tick_s: float = Field(0.25, gt=0, description="Seconds between health checks.")
    warm_spares: int = Field(1, ge=0, description="Idle island processes kept ready per pool (imports done): a restart "
                             "activates one in under a second instead of starting a process.")
    salvage_every_steps: int = Field(5, ge=0, description="Every this many inner steps an island leaves its unsubmitted progress with its "
                                     "pool's keeper; when it dies that progress is merged instead of lost (policies/salvage.py). 0 = off.")


class CheckpointSection(_Section):
    """Outer-optimizer checkpoints: atomic, checksummed, the last `keep` kept."""

    uri: str | None = Field(None, description="Local path or pyarrow.fs URI; None = RUN_DIR/checkpoints.")
    every_s: float = Field(15.0, gt=0, description="Seconds between checkpoints of the outer optimizer.")
    keep: int = Field(3, ge=1, description="Checkpoints kept; older ones are deleted.")


class NetworkSection(_Section):
    """EMULATED wide-area network between the pools' regions and the outer optimizer (policies.network).

    Submissions reach the outer optimizer only after their uplink transfer, and published fragments reach
    each island only after its downlink transfer, on per-region links scaled so that communication time /
    compute time per step matches a 12B-parameter model on the named network (docs/network.md).
    """

    scenario: str = Field("none", description="none (no delay) | lan | wan-4-regions | wan-8-regions; pool regions must be in the scenario.")
    hub_region: str | None = Field(None, description="Region of the outer optimizer (the star's hub); None = the scenario's "
                                      "(us-central for the WANs, the first pool's region otherwise).")
    local_step_s: float | None = Field(None, gt=0, description="Inner-step compute time in seconds used for the scaling; "
                                         "None = measure a few inner steps of the model at setup.")
    step_concurrency: int | None = Field(None, ge=1, description="Inner steps timed side by side when measuring local_step_s; None = every "
                                          "island worker of the config on a one-node Ray cluster, 1 on a multi-node one.")

    @field_validator("scenario")
    @classmethod
    def _scenario(cls, v: str) -> str:
        if v not in NETWORK_SCENARIOS:
            raise ValueError(f"unknown network scenario {v!r}; use one of {', '.join(NETWORK_SCENARIOS)}")
        return v


class RunSection(_Section):
    """Run-level settings: stop rule, seeds, timeouts."""

    token_budget: int = Field(3_000_000, gt=0, description="Stop when the islands together have processed this many tokens.")
    max_wall_s: float | None = Field(None, gt=0, description="Hard wall-clock stop in seconds (None = only the token budget).")
    stop_at_eval_loss: float | None = Field(None, gt=0, description="Stop early once the held-out loss (nats/byte) is at or below this at 2 "
                                             "evaluations in a row (None = never); for timing a run to a target loss.")
    seed: int = Field(0, ge=0, description="Seed for model init, data order and emulation jitter.")
    final_flush: bool = Field(True, description="At stop, cut every island's unsubmitted progress into submissions and merge them "
                              "whatever the quorum (else that work is lost), as one step to their weighted mean (no RDA, no momentum).")
    placement_timeout_s: float = Field(120.0, gt=0, description="How long to wait for an island's placement group.")
    call_timeout_s: float = Field(60.0, gt=0, description="Timeout of control-plane calls (status, adopt, stop).")
    trackers: list[str] = Field(default_factory=list, description="Experiment trackers the run logs to: mlflow[:URI], "
                                "tensorboard[:DIR], wandb[:PROJECT] (docs/trackers.md); their packages: the trackers extra.")

    @field_validator("trackers", mode="before")
    @classmethod
    def _one_tracker(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v  # `--set run.trackers=mlflow`: one tracker, not a list of one

    @field_validator("trackers")
    @classmethod
    def _trackers(cls, v: list[str]) -> list[str]:
        for entry in v:
            tracker_spec(entry)  # a one-line ValueError naming the bad entry and the forms taken
        return v

    # Experimental: off by default (docs/config.md).
    average_window: float | None = Field(None, gt=0, le=1, description="Experimental: serve a moving average of the "
        "global model over this fraction of merged tokens (policies/averaging.py); islands train on the raw one. None = off. "
        "Costs a float32 model copy.")


class RunConfig(_Section):
    """Everything a run needs. Load with `load_config`; the defaults are the shipped configs/default.yaml."""

    mode: Literal["decoupled", "sync-diloco", "streaming-diloco"] = Field(
        "decoupled",
        description="'decoupled' (K=1, grace, token weights, RDA), 'sync-diloco' (K=all, mean, P=1) or "
        "'streaming-diloco' (K=all, mean, P fragments in turn).",
    )
    run: RunSection = Field(default_factory=RunSection, description="Stop rule, seed, timeouts.")
    model: ModelSection = Field(default_factory=ModelSection, description="Model preset and overrides.")
    data: DataSection = Field(default_factory=DataSection, description="Corpus and batch size.")
    inner: InnerSection = Field(default_factory=InnerSection, description="Inner AdamW settings.")
    outer: OuterSection = Field(default_factory=OuterSection, description="Outer optimizer settings.")
    eval: EvalSection = Field(default_factory=EvalSection, description="Held-out evaluation.")
    chaos: ChaosSection = Field(default_factory=ChaosSection, description="Fault injection (chaos engineering).")
    health: HealthSection = Field(default_factory=HealthSection, description="Health monitoring and restarts.")
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, description="Outer-optimizer checkpoints.")
    network: NetworkSection = Field(default_factory=NetworkSection, description="EMULATED network between regions (none = no delay).")
    pools: list[PoolConfig] = Field(
        default_factory=lambda: [
            PoolConfig(name="fast", islands=2, cpus_per_island=0.5),
            PoolConfig(name="slow", islands=2, cpus_per_island=0.5, emulated_slowdown=1.6, emulated_jitter=0.1),
        ],
        description="Hardware pools and their islands.",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_mode(cls, data: Any) -> Any:
        # A mode is a preset of outer settings; an explicit conflicting value is an error, not a silent override.
        # A mode that is not a word, or an outer that is not a section, is left to the fields' own checks.
        if not isinstance(data, dict) or not isinstance(data.get("mode"), str) or not MODE_PRESETS.get(data["mode"]):
            return data
        if not isinstance(data.get("outer") or {}, (dict, BaseModel)):
            return data
        mode = data["mode"]
        outer = dict(data.get("outer") or {})
        for key, value in MODE_PRESETS[mode].items():
            if key in outer and outer[key] != value:
                raise ValueError(
                    f"outer.{key}={outer[key]!r} conflicts with mode {mode} (which uses {value!r}); "
                    f"drop outer.{key} or use mode decoupled"
                )
            outer[key] = value
        return {**data, "outer": outer}

    @model_validator(mode="after")
    def _pools(self) -> RunConfig:
        if not self.pools:
            raise ValueError("pools is empty; define at least one pool with islands >= 1")
        if self.required_islands < 1:
            raise ValueError("every pool's islands.min is 0, so the run could start with no island; give one pool "
                             "islands.min >= 1")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        self._fsdp_supported()
        k = self.outer.min_quorum
        if isinstance(k, int) and k > self.num_islands:
            raise ValueError(f"outer.min_quorum={k} exceeds the {self.num_islands} islands; lower it or use 'all'")
        return self

    @model_validator(mode="after")
    def _outer_step_from_regime(self) -> RunConfig:
        # outer.lr and outer.momentum the config leaves unset follow the run's shape (policies/outer_regime.py);
        # set here, so the recorded config.yaml and every report show the values the run used.
        from policies.outer_regime import regime_outer_step

        o = self.outer
        rule = regime_outer_step(islands=self.num_islands) if o.optimizer is None else None
        if rule is not None:
            for name in ("lr", "momentum"):
                if name not in o.model_fields_set:
                    setattr(o, name, getattr(rule, name))
        return self

    @model_validator(mode="after")
    def _no_inert_settings(self, info: ValidationInfo) -> RunConfig:
        # A config read back from a run directory holds what the engine resolved (build_config(recorded=True));
        # overrides applied to one are checked alone (`only`: the keys they set).
        context = info.context or {}
        if not context.get("recorded"):
            why = inert_setting(self, only=context.get("only"))
            if why is not None:
                raise InertSetting(why)
        return self

    def _fsdp_supported(self) -> None:
        # What an FSDP island cannot do yet (docs/islands.md, FSDP islands): each would need a whole model's
        # worth of tensors on one worker, which sharding exists to avoid.
        fsdp = [p.name for p in self.pools if p.shard == "fsdp"]
        if not fsdp:
            return
        if self.health.salvage_every_steps > 0:
            raise ValueError(f"pools {fsdp} shard 'fsdp' but health.salvage_every_steps is "
                             f"{self.health.salvage_every_steps}: a progress snapshot covers every fragment, the whole "
                             f"model on one worker; set health.salvage_every_steps: 0 or shard: none")
        if _compressor(self.outer.compression).needs_feedback:
            raise ValueError(f"pools {fsdp} shard 'fsdp' but outer.compression {self.outer.compression!r} keeps an "
                             f"error-feedback residual of every fragment on the leader; use "
                             f"{_compressor_names(lambda c: not c.needs_feedback)}, or shard: none")

    @property
    def num_islands(self) -> int:
        """Total island slots over all pools (an elastic pool counts its maximum)."""
        return sum(p.islands for p in self.pools)

    @property
    def required_islands(self) -> int:
        """Islands that must be placed before the run starts (every slot unless a pool is elastic)."""
        return sum(p.required_islands for p in self.pools)

    def elastic_slots(self) -> frozenset[int]:
        """Island slots of elastic pools (numbered over the pools in config order)."""
        out, first = set(), 0
        for p in self.pools:
            if p.elastic:
                out.update(range(first, first + p.islands))
            first += p.islands
        return frozenset(out)

    def precision_of(self, pool: PoolConfig) -> str:
        """The inner-step arithmetic of `pool`'s islands: its own `precision`, else inner.precision."""
        return pool.precision or self.inner.precision

    def min_quorum_count(self) -> int:
        """K as a number ('all' resolved to the number of islands)."""
        k = self.outer.min_quorum
        return self.num_islands if k == "all" else int(k)

    @property
    def emulated(self) -> bool:
        """True when any pool's speed is emulated (every report must say so)."""
        return any(p.emulated for p in self.pools)


class InertSetting(ValueError):
    """A setting given a value that has no effect under the config's other settings (INERT_RULES)."""


@dataclass(frozen=True)
class InertRule:
    """When setting `field` ("section.name"; "pools.name" for each pool) has no effect, and the fix.

    `inert(cfg)` says why the field does nothing in `cfg`, or None where it does something; `fix` is
    the one-line way out. Pure reads of the config: no I/O.
    """

    field: str
    inert: Callable[[RunConfig], str | None]
    fix: str


def _unless_python(rule: Callable[[RunConfig], str | None]) -> Callable[[RunConfig], str | None]:
    # Source 'python' is what a run on datasets from Python records: they replaced the corpus, so the rules
    # of the corpus sources do not apply to it (and the run was checked under the source it was given).
    return lambda cfg: None if cfg.data.source == "python" else rule(cfg)


def _src(*sources: str) -> Callable[[RunConfig], bool]:
    return lambda cfg: cfg.data.source in sources


def _compressor(name: str) -> Any:
    """The compressor plug-in `name` names (policies/compressor.py): config checks read its properties."""
    from islands.plugins import load_compressor  # torch, only once a config is checked

    return load_compressor(name)


def _compressor_names(has: Callable[[Any], bool], last: str = "or") -> str:
    """The built-in compressors that `has` holds for, as prose ("a, b or c"): what a message suggests (a user's
    plug-in loaded in this process is left out, so a message does not depend on what ran before)."""
    from policies.compression import SCHEMES

    chosen = [n for n in SCHEMES if has(_compressor(n))]
    return ", ".join(chosen[:-1]) + f" {last} " + chosen[-1] if len(chosen) > 1 else (chosen or ["none"])[0]


def _blocked_formats(cfg: RunConfig) -> bool:
    o = cfg.outer
    return any(_compressor(f).blocked for f in (o.compression, o.downlink, o.downlink_delta) if f is not None)


def _density_formats(cfg: RunConfig) -> bool:
    o = cfg.outer
    return any(_compressor(f).uses_density for f in (o.compression, o.downlink_delta) if f is not None)


def _plugin(cfg: RunConfig, what: str) -> str | None:
    """Why a setting of the built-in outer SGD does nothing under a user's outer optimizer, else None."""
    if cfg.outer.optimizer is None:
        return None
    return f"outer.optimizer {cfg.outer.optimizer!r} replaces the built-in Nesterov SGD, whose {what} it is"


INERT_RULES: tuple[InertRule, ...] = (
    InertRule("data.path", _unless_python(lambda c: "data.source is 'stdlib', which reads no files" if _src("stdlib")(c) else None),
              "set data.source=parquet (or tokens for token files), or drop data.path"),
    InertRule("data.text_column", _unless_python(
        lambda c: None if _src("parquet")(c) else f"only data.source=parquet has columns, and it is '{c.data.source}'"),
              "set data.source=parquet, or drop data.text_column"),
    InertRule("data.token_column", _unless_python(
        lambda c: None if _src("parquet")(c) else f"only data.source=parquet has columns, and it is '{c.data.source}'"),
              "set data.source=parquet, or drop data.token_column"),
    InertRule("data.tokenizer", _unless_python(
        lambda c: "token files are token ids already" if _src("tokens")(c) else
        "data.token_column is token ids already" if c.data.token_column is not None else None),
              "set data.tokenizer=bytes, or train on a text column (data.source=parquet, data.text_column)"),
    InertRule("data.token_dtype", _unless_python(
        lambda c: None if _src("tokens")(c) else f"only token files (data.source=tokens) have a width, and data.source is "
                                                 f"'{c.data.source}'"),
              "drop data.token_dtype, or set data.source=tokens"),
    InertRule("data.max_bytes", _unless_python(
        lambda c: None if _src("stdlib")(c) else f"it caps the stdlib corpus, and data.source is '{c.data.source}'"),
              "drop data.max_bytes (a corpus at data.path trains on what it holds)"),
    InertRule("data.unit_tokens", _unless_python(
        lambda c: "Parquet units are its row groups, not token counts" if _src("parquet")(c) else None),
              "drop data.unit_tokens (it cuts token files and token arrays from Python)"),
    InertRule("data.unit_examples", _unless_python(
        lambda c: f"only datasets of examples passed from Python are cut by it, and data.source is '{c.data.source}'"
        if _src("parquet", "tokens")(c) else None),
              "drop data.unit_examples"),
    InertRule("data.vocab_size", _unless_python(
        lambda c: "text read as bytes (data.tokenizer=bytes) has 256 ids" if c.data.tokenizer == "bytes" and (
            _src("stdlib")(c) or (_src("parquet")(c) and c.data.text_column is not None)) else None),
              "drop data.vocab_size, or set data.tokenizer=train to train a vocabulary of that size"),
    InertRule("data.tokenizer_sample_bytes", _unless_python(
        lambda c: None if c.data.tokenizer == "train" else f"only data.tokenizer=train reads a sample, and it is "
                                                           f"{c.data.tokenizer!r}"),
              "set data.tokenizer=train, or drop data.tokenizer_sample_bytes"),
    InertRule("pools.data_path", _unless_python(
        lambda c: "copies are for parquet or token-file corpora, and data.source is 'stdlib'" if _src("stdlib")(c) else None),
              "drop data_path from the pool"),
    InertRule("inner.lr_final_ratio", lambda c: "inner.lr_schedule is 'constant', which never decays"
              if c.inner.lr_schedule == "constant" else None, "set inner.lr_schedule=cosine, or drop inner.lr_final_ratio"),
    InertRule("outer.compression_block_size", lambda c: None if _blocked_formats(c) else
              f"no wire format in use has blocks (outer.compression '{c.outer.compression}', outer.downlink "
              f"'{c.outer.downlink}', outer.downlink_delta {c.outer.downlink_delta or 'null'})",
              "use int8, int4, int2 or sign for one of them, or drop outer.compression_block_size"),
    InertRule("outer.topk_density", lambda c: None if _density_formats(c) else
              "neither outer.compression nor outer.downlink_delta is topk",
              "set one of them to topk, or drop outer.topk_density"),
    InertRule("outer.feedback_decay", lambda c: None if _compressor(c.outer.compression).needs_feedback else
              f"outer.compression is '{c.outer.compression}', which owes nothing to later submissions "
              f"({_compressor_names(lambda k: k.needs_feedback, 'and')} do)", "set outer.compression to int2, sign or topk, or drop outer.feedback_decay"),
    InertRule("outer.lr", lambda c: _plugin(c, "learning rate"), "drop outer.lr (give the factory its lr), or drop outer.optimizer"),
    InertRule("outer.momentum", lambda c: _plugin(c, "momentum"),
              "drop outer.momentum (give the factory its momentum), or drop outer.optimizer"),
    InertRule("outer.partial_momentum", lambda c: _plugin(c, "partial-round momentum") or (None if c.outer.step_scale == "clock" else
              f"only outer.step_scale=clock uses it, and it is '{c.outer.step_scale}'"),
              "drop outer.partial_momentum, or set outer.step_scale=clock with the built-in optimizer (outer.optimizer null)"),
    InertRule("chaos.horizon_s", lambda c: None if c.chaos.mode == "poisson" else
              f"only chaos mode poisson draws faults over a horizon, and it is '{c.chaos.mode}' (fixed spreads its "
              f"faults over the token budget)", "drop chaos.horizon_s, or use chaos mode poisson"),
    InertRule("chaos.params", lambda c: "chaos.mode is 'none', which injects nothing" if c.chaos.mode == "none" else None,
              "set chaos.mode (or pass --chaos SPEC), or drop chaos.params"),
    InertRule("network.local_step_s", lambda c: "network.scenario is 'none', which emulates no links"
              if c.network.scenario == "none" else None, "set network.scenario, or drop network.local_step_s"),
    InertRule("network.step_concurrency", lambda c: "network.scenario is 'none', which times no steps"
              if c.network.scenario == "none" else None, "set network.scenario, or drop network.step_concurrency"),
)
"""Settings refused where the others leave them no effect (docs/config.md, "Settings that have no effect")."""


def given_setting(section: BaseModel, name: str) -> bool:
    """Whether the config gave `section.name` a value of its own: set explicitly, and not to its default."""
    if name not in section.model_fields_set:
        return False
    info = type(section).model_fields[name]
    default = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
    return getattr(section, name) != default


def _overridden(only: tuple[tuple[str, ...], ...] | None, parts: tuple[str, ...]) -> bool:
    """Whether the overrides `only` set field `parts` (or a section or list holding it); True when `only` is None."""
    return only is None or any(parts[:len(key)] == key for key in only)


def inert_setting(cfg: RunConfig, *, only: tuple[tuple[str, ...], ...] | None = None) -> str | None:
    """The first setting `cfg` gives that has no effect under its other settings, in one line with the fix; else None.

    `only`: check just the fields these override keys set (a pool by index or name), as for overrides applied to
    a config already checked; None checks every field."""
    for rule in INERT_RULES:
        section, name = rule.field.split(".")
        if section == "pools":
            holders = [(f"pools.{printable(p.name)}.{name}", p, [("pools", k, name) for k in (str(i), p.name)])
                       for i, p in enumerate(cfg.pools)]
        else:
            holders = [(rule.field, getattr(cfg, section), [(section, name)])]
        for shown, holder, keys in holders:
            if any(_overridden(only, k) for k in keys) and given_setting(holder, name):
                why = rule.inert(cfg)
                if why is not None:
                    fix = rule.fix if section != "pools" else rule.fix.replace("the pool", f"pools.{printable(holder.name)}")
                    return f"{shown}={getattr(holder, name)!r} has no effect: {why}; {fix}"
    return None


def build_config(data: dict[str, Any], *, recorded: bool = False) -> RunConfig:
    """Validate a plain dict into a RunConfig, raising ConfigError with a one-line message.

    Settings that have no effect under the others are refused (INERT_RULES). `recorded`: `data` is a config a
    run wrote into its run directory (the engine's resolution of what it was given: datasets from Python as
    source 'python', a measured step time) or one already checked: taken as it is, since the run was checked
    when it started and an older version may not have known a rule. `data` from :func:`apply_overrides` (an
    :class:`Overridden`) is checked in the fields its overrides set alone: its base is a run's config or the
    caller's own (``diloco evaluate RUN --set data.source=parquet ...`` leaves the run's stdlib cap alone;
    a `data.path` it adds under source stdlib is refused). :func:`load_config` checks every field.
    """
    only = data.overridden if isinstance(data, Overridden) else None
    try:
        return RunConfig.model_validate(data, context={"recorded": recorded, "only": only})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, RunConfig)) from None


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r} is not key=value; write e.g. --set outer.min_quorum=2")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set {item!r} has an empty key; write e.g. --set run.token_budget=100000")
    if not raw.strip():
        return path, None
    try:
        return path, yaml.safe_load(raw)
    except yaml.YAMLError as err:  # an unclosed bracket or quote, a tab or control character, an unknown tag
        why, name = printable(getattr(err, "problem", None) or str(err).splitlines()[0]), printable(".".join(path))
        raise ConfigError(f"--set {item!r}: the value of {name} is not valid YAML ({why}); close its brackets and "
                          f"quotes, or quote it whole as a string: --set \"{name}='...'\"") from None


def _list_entry(item: str, key: str, entries: list[Any], part: str) -> Any:
    """The entry of list `key` that `part` names: an index, or the `name` of a dict entry (pools by name)."""
    key = printable(key)
    names = [printable(str(e.get("name"))) for e in entries if isinstance(e, dict)]
    if not entries:
        raise ConfigError(f"--set {item!r}: {key} is empty, so it has no entry '{printable(part)}'; set the whole list "
                          f"instead, e.g. --set '{key}=[...]'")
    if re.fullmatch(r"-?[0-9]+", part):  # ASCII digits: '²'.isdigit() holds, int('²') does not
        i = int(part)
        if not 0 <= i < len(entries):
            raise ConfigError(f"--set {item!r}: {key} has {len(entries)} entries, so index {i} does not exist; "
                              f"use 0..{len(entries) - 1}" + (f" or a name ({', '.join(names)})" if names else ""))
        return entries[i]
    for e in entries:
        if isinstance(e, dict) and e.get("name") == part:
            return e
    raise ConfigError(f"--set {item!r}: {key} has no entry named '{printable(part)}'; use "
                      + (f"one of {', '.join(names)} or " if names else "") + f"an index 0..{len(entries) - 1}")


class Overridden(dict):
    """What :func:`apply_overrides` returns: the config dict, and the keys its overrides set (`overridden`, as
    tuples of the key's parts), which :func:`build_config` checks for settings that have no effect."""

    overridden: tuple[tuple[str, ...], ...] = ()


# A caller may write the dict out as YAML (a config file for a test or a benchmark): it is a plain mapping there.
for _dumper in (yaml.SafeDumper, yaml.Dumper):
    yaml.add_representer(Overridden, yaml.representer.SafeRepresenter.represent_dict, Dumper=_dumper)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> Overridden:
    """Apply dotted `key=value` overrides (values parsed as YAML) to a config dict, returning a new dict.

    A part after a list picks one entry, by index or by its `name`: `pools.1.islands=3` or
    `pools.slow.emulated_slowdown=2`. A list the dict does not have yet starts as its default
    (RunConfig's), so this works without a config file too.
    """
    out = Overridden(yaml.safe_load(yaml.safe_dump(dict(data))))  # deep copy through plain types
    parsed = [(item, *_parse_override(item)) for item in overrides]  # every item's key and value checked first
    out.overridden = (data.overridden if isinstance(data, Overridden) else ()) + tuple(tuple(path) for _, path, _ in parsed)
    for item, path, value in parsed:
        node: Any = out
        for depth, part in enumerate(path[:-1]):
            if isinstance(node, list):
                child = _list_entry(item, ".".join(path[:depth]), node, part)
            else:
                child = node.get(part)
                if child is None:
                    listed = depth == 0 and get_origin(getattr(RunConfig.model_fields.get(part), "annotation", None)) is list
                    default = _default_lists().get(part) if listed else None  # a section starts empty: no defaults to build
                    child = node[part] = default if default is not None else {}
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"--set {item!r}: '{printable(part)}' is not a section")
            node = child
        if isinstance(node, list):
            raise ConfigError(f"--set {item!r}: {printable('.'.join(path))} is a whole entry of a list; set one of its "
                              f"fields, e.g. --set {printable('.'.join(path))}.islands=2")
        node[path[-1]] = value
    return out


def _default_lists() -> dict[str, Any]:
    """The built-in config's top-level lists (pools), as plain data."""
    return {k: v for k, v in RunConfig().model_dump(mode="json").items() if isinstance(v, list)}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *,
                also_mode: str | None = None) -> RunConfig:
    """Load a RunConfig from a YAML file (None = built-in defaults) plus `key=value` overrides.

    `also_mode`: a file whose `mode:` is this value loads too, the mode dropped (`diloco baseline-dp`
    passes "data-parallel", so a data-parallel run's own config.yaml runs it again).
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing YAML file to --config")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {str(err).splitlines()[0]}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {err.start} is {err.object[err.start]:#04x}); "
                              f"save it as UTF-8") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level, got {type(loaded).__name__}")
        data = loaded or {}
        if also_mode is not None and data.get("mode") == also_mode:
            data = {k: v for k, v in data.items() if k != "mode"}
    if overrides:
        data = dict(apply_overrides(data, overrides))  # the file and the overrides alike are the caller's: all checked
    return build_config(data)


def resume_conflict(saved: RunConfig, new: RunConfig) -> str | None:
    """Why `new` cannot continue a run started with `saved` (None when it can), in one line.

    A resumed run continues from the outer optimizer's checkpoints and every island's data cursor, so
    whatever shapes the parameters or the data each cursor points into stays: the model, the data and
    its batching, the seed, the fragments, the islands of each pool and their workers (worker r of an
    island reads batch cursor * W + r), the mode and where the checkpoints are. Budget, timeouts,
    evaluation, health, chaos, network and the outer optimizer's hyperparameters may change.
    """
    def frozen(cfg: RunConfig) -> dict[str, Any]:
        flat = {f"model.{k}": v for k, v in cfg.model.model_dump().items()}
        flat.update({f"data.{k}": v for k, v in cfg.data.model_dump().items()})
        flat.update({"mode": cfg.mode, "run.seed": cfg.run.seed, "outer.num_fragments": cfg.outer.num_fragments,
                     "checkpoint.uri": cfg.checkpoint.uri,
                     "pools": [f"{p.name}: {p.islands} islands x {p.workers_per_island} workers" for p in cfg.pools]})
        return flat

    old, now = frozen(saved), frozen(new)
    for key, was in old.items():
        if now[key] != was:
            return (f"--resume cannot change {key} (the run has {was}, asked for {now[key]}): its checkpoints and "
                    f"data cursors belong to the original; drop that --set, or start a new run")
    return None
