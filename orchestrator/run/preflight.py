"""Checks of a training run that need no Ray: run before Ray starts and before the run directory exists.

`diloco train` calls `preflight` before it imports the driver (which imports Ray and torch), and
`driver.train()` calls it again before `ensure_ray`, so a notebook's bad input fails as fast. Each
problem is one `ConfigError` line that names the fix in the CLI's spelling (`--set data.path=...`);
the CLI prints it and exits with code 2. Nothing here imports Ray or torch, starts a process or
writes a file: Parquet inputs are judged by their footers (schema, row-group statistics), never by
their rows. What only a started Ray can tell (a pool that the local node cannot host) is checked by
`driver.check_local_fit` right after Ray starts, still before the run directory is created.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from orchestrator.config import ConfigError, RunConfig, build_config

__all__ = ["preflight", "resume_config"]


def preflight(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False) -> None:
    """Raise ConfigError (one line naming the fix) for the first problem of `cfg` that would otherwise
    surface only after Ray started: the model shape, the dataset (path, column, type, token ids), the
    network regions, the chaos tape, the trackers' packages, and a fresh run over a run directory that holds
    checkpoints."""
    vocab_size = _check_model(cfg)
    _check_data(cfg, vocab_size)
    _check_network(cfg)
    _check_chaos(cfg)
    _check_trackers(cfg)
    _check_run_dir(cfg, Path(run_dir), resume=resume)


def resume_config(run_dir: str | Path) -> RunConfig:
    """The config a run directory was started with (for `diloco train --resume RUN_DIR`)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml; --resume needs the directory of an earlier run")
    return build_config(yaml.safe_load(path.read_text()), recorded=True)


def _check_trackers(cfg: RunConfig) -> None:
    """Every tracker of run.trackers has its package installed (found, not imported: MLflow takes seconds)."""
    if cfg.run.trackers:
        from orchestrator.run.trackers import check_installed

        check_installed(cfg)


def _check_model(cfg: RunConfig) -> int:
    """The model's vocabulary size, after checking that the preset exists and the overrides fit it."""
    from islands.spec import PRESETS

    m = cfg.model
    if m.preset not in PRESETS:
        raise ConfigError(f"unknown model preset {m.preset!r}; pass one of {', '.join(sorted(PRESETS))}, "
                          f"e.g. --set model.preset=tiny")
    try:
        return m.shape().vocab_size
    except ValueError as err:
        fields = " ".join(f"--set model.{k}=..." for k in m.overrides())
        raise ConfigError(f"model {m.preset!r} with {m.overrides()}: {err}; change {fields}") from None


def _check_data(cfg: RunConfig, vocab_size: int) -> None:
    """A Parquet source's path, column and column type from its footer; token ids against the model's
    vocabulary where the row-group statistics hold them (the loader checks every id later anyway)."""
    import pyarrow as pa

    from islands.data import DataError, dataset_schema, token_id_range

    d = cfg.data
    if d.source == "tokens":
        _check_units(cfg)
    if d.source != "parquet":
        return
    try:
        schema = dataset_schema(d.path)
    except DataError as err:
        raise ConfigError(f"{err}: --set data.path=PATH") from None
    is_text = d.text_column is not None
    name, field = (d.text_column, "text_column") if is_text else (d.token_column, "token_column")
    if name not in schema.names:
        raise ConfigError(f"column {name!r} not found in {d.path!r}; its columns are {', '.join(schema.names)}; "
                          f"pass one with --set data.{field}=NAME")
    kind = schema.field(name).type
    if is_text and not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ConfigError(f"column {name!r} in {d.path!r} has type {kind}, not string; pass a string column with "
                          f"--set data.text_column=NAME, or a list<int> column of token ids with "
                          f"--set data.token_column=NAME --set data.text_column=null")
    if not is_text:
        listed = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
        if not (listed and pa.types.is_integer(kind.value_type)):
            raise ConfigError(f"column {name!r} in {d.path!r} has type {kind}, not list<int>; pass a column of "
                              f"token-id lists with --set data.token_column=NAME, or a string column with "
                              f"--set data.text_column=NAME --set data.token_column=null")
        span = token_id_range(d.path, name)
        # The built-in model takes its vocabulary from the ids (or data.vocab_size); a user's model is checked
        # against its own embedding once built (orchestrator/run/workload.py prepare).
        limit = d.vocab_size
        if span is not None and (span[0] < 0 or (limit is not None and span[1] >= limit)):
            raise ConfigError(f"token ids in column {name!r} of {d.path!r} span [{span[0]}, {span[1]}] but "
                              f"data.vocab_size is {limit}; raise it with --set data.vocab_size={span[1] + 1}, "
                              "or re-tokenize the column" if span[0] >= 0 else
                              f"token ids in column {name!r} of {d.path!r} start at {span[0]}; ids are never "
                              "negative: re-tokenize the column")
    _check_units(cfg)


def _check_units(cfg: RunConfig) -> None:
    """The corpus cuts into units (metadata only: footers, file sizes), and every pool's copy holds the same units."""
    from islands.data import DataError
    from orchestrator.run.streams import check_copies, corpus_index

    try:
        check_copies(cfg, corpus_index(cfg))
    except DataError as err:
        raise ConfigError(str(err)) from None


def _check_network(cfg: RunConfig) -> None:
    """The pools' regions (and hub) exist in the network scenario; sizes are placeholders here (the
    driver scales the links to the measured step and the model's bytes)."""
    from policies.network import build_network

    n = cfg.network
    try:
        build_network(n.scenario, [p.region for p in cfg.pools], model_bytes=1, local_step_s=1.0,
                      hub_region=n.hub_region)
    except ValueError as err:
        raise ConfigError(f"network: {err} (--set pools.NAME.region=... or --set network.hub_region=...)") from None


def _check_chaos(cfg: RunConfig) -> None:
    """The chaos tape builds: its file exists and parses, its parameters fit the mode."""
    from policies.chaos import tape_from_config

    try:
        tape_from_config(cfg.chaos.spec(), islands=cfg.num_islands, horizon_s=cfg.chaos.horizon_s)
    except (ValueError, OSError) as err:
        raise ConfigError(f"chaos: {err} (fix --chaos SPEC or --set chaos.params...)") from None


def _check_run_dir(cfg: RunConfig, run_dir: Path, *, resume: bool) -> None:
    """A fresh run must not start over another run's checkpoints (the driver's prepare_run_dir says the
    same after Ray started). Only a local checkpoint directory that exists already is looked into:
    opening a store creates its directory, and a preflight writes nothing (a remote checkpoint.uri is
    left to prepare_run_dir). The checkpoint module imports torch, so only then is it loaded."""
    uri = cfg.checkpoint.uri
    if resume or (uri is not None and "://" in uri):
        return
    local = (run_dir / "checkpoints" if uri is None else Path(uri)).expanduser()
    if not local.is_dir():
        return
    from orchestrator.core.checkpoint import CheckpointStore

    if CheckpointStore(str(local.resolve())).list():
        if uri is None:
            raise ConfigError(f"{run_dir} already holds checkpoints; continue it with --resume {run_dir} "
                              f"or pick a new --run-dir")
        raise ConfigError(f"checkpoint.uri {uri!r} already holds checkpoints; continue that run with --resume, "
                          f"or pick a new place with --set checkpoint.uri=...")
