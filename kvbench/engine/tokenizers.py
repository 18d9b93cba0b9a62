"""An offline byte-level tokenizer for the tiny random test models.

Every UTF-8 byte is one token, so any string round-trips through
encode -> decode, and nothing has to be downloaded.
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in character for each byte value 0..255 (what ByteLevel emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)]


def _byte_vocab() -> dict[str, int]:
    """Token id = byte value, so ids are easy to read while debugging."""
    return {symbol: byte for byte, symbol in enumerate(_byte_symbols())}


def byte_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with ``<bos>``/``<eos>``/``<pad>`` that prepends ``<bos>`` like Llama."""
    backend = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, backend.token_to_id(BOS_TOKEN))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def stand_in_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
    """The byte tokenizer with a plain chat template: it stands in for a checkpoint's tokenizer that is not on
    this machine when a job's settings are validated without it (``kvbench plan``)."""
    tokenizer = byte_tokenizer(model_max_length)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer
