"""The RL floor's view of samples: the sample's schema and columnar form (:mod:`engine.schema.sample`),
the rollout table (:mod:`engine.schema.table`), and the run's text decoder for the table's text.
"""

from __future__ import annotations

from ..config import config_from_stored
from ..schema.sample import FIELDS, PAD, SCALARS, SEQUENCES, UNKNOWN_VERSION, Columns, EnvEnd, Sample, pack, unpack
from ..schema.table import (
    COLUMNS,
    EPISODE_COLUMNS,
    FATE,
    TABLE_NAMES,
    TEXT,
    TURNS,
    arrow_schema,
    num_rows,
    parquet_options,
    require_pyarrow,
    rows,
    step_columns,
    table_columns,
    to_arrow,
    turn_rows,
    turn_schema,
)

__all__ = ["COLUMNS", "EPISODE_COLUMNS", "FATE", "FIELDS", "PAD", "SCALARS", "SEQUENCES", "TABLE_NAMES", "TEXT", "TURNS", "UNKNOWN_VERSION", "Columns", "EnvEnd", "Sample",
           "arrow_schema", "num_rows", "pack", "parquet_options", "require_pyarrow", "rows", "step_columns", "table_columns",
           "to_arrow", "turn_rows", "turn_schema", "unpack"]


def ran_episodes(configs: list[dict]) -> bool:
    """Whether steps run under these stored configs (Ledger.configs_in) played episodes (rollout.env):
    their rollout table has the episode columns."""
    return any(config_from_stored(c).rollout.env for c in configs)


def text_decoder(config: dict | None):
    """The run's decoder (built-in vocabulary or tokenizer.json), or None when it cannot be found."""
    from .vocab import TextDecoder, builtin_chars

    cfg = config_from_stored(config, unknown="none")
    if cfg is None:
        return None
    path = cfg.model.actor.model_name_or_path
    chars = builtin_chars(cfg.model.tiny.vocab, cfg.data.train_dataset or "")
    try:
        return TextDecoder(path, chars) if path else None
    except Exception:  # noqa: BLE001 - no tokenizer.json (model dir moved): show token ids instead
        return None
