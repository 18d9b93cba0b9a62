"""What a job is built of: its task (checked first, for the model's tokenizer or a stand-in), its engine, its stop
tokens."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig

from kvbench.engine import Engine
from kvbench.engine.calibration import calibration_refusal
from kvbench.engine.kivi import kivi_of, quant_model_refusal
from kvbench.engine.refusals import has_learned_sinks, held_windows, model_refusal
from kvbench.engine.runner import head_dim_of
from kvbench.errors import KVBenchError
from kvbench.identity import node_settings_key
from kvbench.job import Job
from kvbench.models import LoadedModel, ModelSpec, check_weights, load_tokenizer, model_skeleton
from kvbench.policies import build_policy
from kvbench.tasks.base import ModelInfo, Sample, Task

log = logging.getLogger("kvbench.run")  # one logger for the run layer (the jobs' log lines name it)


def build_task(cfg: DictConfig, tokenizer) -> Task:
    """Instantiate the task class named by ``task._target_`` for this model's tokenizer, window and id."""
    try:
        task_class = get_class(cfg.task._target_)
    except Exception as error:
        raise KVBenchError(f"task {cfg.task.name!r}: cannot import {cfg.task._target_}: {error}") from None
    model = ModelSpec.of(cfg.model)
    info = ModelInfo(model.name, tokenizer, model.context_window, model.hf_id)
    return task_class(cfg.task, info)


def checked_task(cfg: DictConfig, tokenizer) -> tuple[Task | None, list[str]]:
    """The job's task, and every reason this machine cannot run the job, found at once and before anything
    loads: weights neither here nor downloadable now, data the same, a task that cannot be built."""
    reasons = []
    try:
        check_weights(ModelSpec.of(cfg.model))
    except KVBenchError as error:
        reasons.append(str(error))
    try:
        refusal = model_refusal_of(cfg)
        if refusal is not None:
            reasons.append(refusal)
    except KVBenchError as error:
        reasons.append(str(error))
    try:
        task = build_task(cfg, tokenizer)
        refusal = task.window_refusal()
        if refusal is not None:
            raise KVBenchError(refusal)
        task.check_data()
    except KVBenchError as error:
        return None, [*reasons, str(error)]
    return (task if not reasons else None), reasons


def model_refusal_of(cfg: DictConfig) -> str | None:
    """Why the job's policy is not defined on its model (:func:`~kvbench.engine.runner.model_refusal`: its sliding
    layers, its learned sinks; a calibration it cannot make; its cache's head size for KIVI), read from the model's
    skeleton before anything loads; None where it is, or where the model's config is not on this machine (the
    weights' check says so)."""
    skeleton = model_skeleton(ModelSpec.of(cfg.model))
    if skeleton is None:
        return None
    policy, config = build_policy(cfg.policy.name, cfg.policy), skeleton.config.get_text_config()
    refusal = model_refusal(policy, held_windows(config), has_learned_sinks(skeleton))
    refusal = refusal or calibration_refusal(policy, skeleton)
    return refusal or quant_model_refusal(kivi_of(cfg.cache), head_dim_of(config))


def local_tokenizer(model: ModelSpec, cache: dict[str, Any] | None = None) -> Any | None:
    """The model's own tokenizer where this machine has it (loaded once per model with ``cache``), else None;
    nothing is downloaded."""
    cache = {} if cache is None else cache
    key = node_settings_key(model.settings())
    if key not in cache:
        try:
            with hub_offline():
                cache[key] = load_tokenizer(model)
        except (KVBenchError, OSError, ValueError):
            cache[key] = None
    return cache[key]


def tokenizer_or_stand_in(model: ModelSpec, tokenizer: Any | None) -> Any:
    """``tokenizer``, or where it is None a stand-in that checks everything a tokenizer does not decide."""
    from kvbench.engine.tokenizers import stand_in_tokenizer

    return stand_in_tokenizer(model.context_window) if tokenizer is None else tokenizer


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Local files only: a checkpoint not on this machine is not downloaded to check or plan a job."""
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE")
        else:
            os.environ["HF_HUB_OFFLINE"] = previous


def build_engine(job: Job, loaded: LoadedModel) -> Engine:
    """The engine running the job's policy and budget on the loaded model, with the job's engine settings."""
    engine = job.engine
    return Engine(
        loaded.model,
        job.policy,
        job.budget,
        regime=engine.regime,
        block_size=engine.block_size,
        decode_evict=engine.decode_evict,
        decode_interval=engine.decode_interval,
        attn_backend=loaded.attn_backend,
        score_block=engine.score_block,
        record_kept=engine.save_kept,
        tokenizer=loaded.tokenizer,
        rows_attention=engine.rows_attention,
        sums_kernel=engine.sums_kernel,
        sampling=engine.sampling,
        quant=engine.quant,
    )


def stop_ids(sample: Sample, loaded: LoadedModel) -> list[int]:
    """The model's stop tokens plus the last token of each of the sample's stop strings (LongBench samsum)."""
    extra = [loaded.tokenizer.encode(text, add_special_tokens=False)[-1] for text in sample.stop_strings]
    return [*loaded.stop_token_ids, *extra]
