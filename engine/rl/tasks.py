"""reasoning-gym tasks: prompts generated locally from a seed, scored by the task's own verifier.

    data.train_dataset: reasoning_gym:basic_arithmetic              # one task
    data.train_dataset: reasoning_gym:basic_arithmetic,chain_sum    # several, mixed by data.reasoning_gym.weights
    data.reasoning_gym.config: {min_terms: 2, max_terms: 2}         # the task's own config (several: {task: config})
    rollout.reward_fn: reasoning_gym                                # (or auto) the task's own score_answer

Row i of the dataset is reasoning-gym's item i of the task (or of its composite, for several) at
``data.reasoning_gym.seed`` (null: the run's seed): rows 0..size-1 are the training set, the
``data.eval_size`` rows after them the held-out set (less any whose question the training set also
holds). So a journal's dataset row means the same prompt on every resume, and the run's identity
records the tasks, their configs, the seed, reasoning-gym's version and a digest of the rows.

The scorer gets the answer the response gives (``rollout.answer_format``): ``text`` is the whole
response, stripped; ``answer_tag`` the text inside its last ``<answer>…</answer>`` (none: score 0).
reasoning-gym is an optional extra: ``pip install 'verlj[tasks]'``.
"""

from __future__ import annotations

from ..config import REASONING_GYM, DataConfig
from ..errors import DataError, install_hint

PREFIX = REASONING_GYM + ":"


def is_task(train_dataset: str) -> bool:
    return train_dataset.startswith(PREFIX)


def task_names(train_dataset: str) -> list[str]:
    names = [n.strip() for n in train_dataset[len(PREFIX):].split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise DataError(f"data.train_dataset: {train_dataset!r} must name reasoning-gym tasks as reasoning_gym:TASK or "
                        "reasoning_gym:TASK,TASK (each once)")
    return names


def _require():
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(f"data.train_dataset=reasoning_gym:... needs reasoning-gym: {install_hint('tasks')}") from None
    return reasoning_gym


def version() -> str:
    from importlib.metadata import version as dist_version

    return dist_version("reasoning-gym")


def _task_configs(cfg: DataConfig, names: list[str]) -> dict[str, dict]:
    rg_cfg = cfg.reasoning_gym
    if len(names) == 1:
        configs = {names[0]: dict(rg_cfg.config)}
    else:
        unknown = sorted(set(rg_cfg.config) - set(names))
        if unknown:
            raise DataError(f"data.reasoning_gym.config: {unknown[0]!r} is not one of the tasks in data.train_dataset; "
                            "with several tasks it maps each task to its own config")
        configs = {n: dict(rg_cfg.config.get(n) or {}) for n in names}
    unknown = sorted(set(rg_cfg.weights) - set(names))
    if unknown:
        raise DataError(f"data.reasoning_gym.weights: {unknown[0]!r} is not one of the tasks in data.train_dataset")
    for name, c in configs.items():
        if not isinstance(c, dict):
            raise DataError(f"data.reasoning_gym.config: the config of {name} must be a mapping, got {c!r}")
        taken = sorted({"seed", "size"} & set(c))
        if taken:
            raise DataError(f"data.reasoning_gym.config: set {taken[0]} with data.reasoning_gym.{taken[0]}, not in the task's config")
    return configs


def generate(cfg: DataConfig, seed: int):
    """(the reasoning-gym dataset over train + held-out rows, its identity). One sentence for an
    unknown task or a config the task refuses."""
    rg = _require()
    names = task_names(cfg.train_dataset)
    configs = _task_configs(cfg, names)
    rg_seed = cfg.reasoning_gym.seed if cfg.reasoning_gym.seed is not None else seed % 2**31
    size = cfg.reasoning_gym.size + cfg.eval_size
    from reasoning_gym.factory import DATASETS

    for name in names:
        if name not in DATASETS:
            raise DataError(f"data.train_dataset: reasoning-gym has no task {name!r} (reasoning-gym {version()} has "
                            f"{len(DATASETS)}: e.g. {', '.join(sorted(DATASETS)[:6])}, ...)")
    try:
        if len(names) == 1:
            ds = rg.create_dataset(names[0], seed=rg_seed, size=size, **configs[names[0]])
        else:
            from reasoning_gym.composite import DatasetSpec

            specs = [DatasetSpec(name=n, weight=float(cfg.reasoning_gym.weights.get(n, 1.0)), config=configs[n]) for n in names]
            ds = rg.create_dataset("composite", seed=rg_seed, size=size, datasets=specs)
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        raise DataError(f"data.reasoning_gym.config: reasoning-gym refused the config of {','.join(names)}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'an assertion failed'}") from None
    identity = {"tasks": names, "configs": configs, "weights": {n: float(cfg.reasoning_gym.weights.get(n, 1.0)) for n in names},
                "seed": rg_seed, "reasoning_gym": version()}
    return ds, identity


class TaskScorer:
    """rollout.reward_fn=reasoning_gym: the task's own score_answer on the answer the response gives."""

    def __init__(self, dataset, answer_format: str):
        self.dataset, self.answer_format = dataset, answer_format

    def __repr__(self) -> str:
        return "reasoning_gym"

    def answer(self, response: str) -> str | None:
        if self.answer_format == "answer_tag":
            from reasoning_gym.utils import extract_answer

            return extract_answer(response)
        return response.strip()

    def score(self, response: str, entry: dict) -> float:
        return float(self.dataset.score_answer(self.answer(response), entry))
