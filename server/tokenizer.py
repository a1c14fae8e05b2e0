"""An offline stand-in for the Qwen3.5 tokenizer: byte-level BPE over the full 248,320-id vocabulary.

No tokenizer can be downloaded, yet text prompts and chat must work end to end on the dummy model.
Every id the model can emit decodes to something, and the chat special tokens sit at their real ids.
Ids 0-255 are the byte alphabet, then every byte pair, then byte triples until the vocabulary is full.
"""

import itertools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from qflash.server.preset import EOS_TOKEN_ID, SPECIAL_TOKENS, VOCAB_SIZE

# ChatML, as Qwen models format conversations; plain string content only.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (what ByteLevel emits)."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    alphabet = _byte_alphabet()
    special_ids = set(SPECIAL_TOKENS.values())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    free_ids = (i for i in itertools.count(len(alphabet)) if i not in special_ids)
    pairs = ((a, b) for a in alphabet for b in alphabet)
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    for (left, right), token_id in zip(itertools.chain(pairs, triples), free_ids):
        if token_id >= VOCAB_SIZE:
            break
        vocab[left + right] = token_id
        merges.append((left, right))
    vocab.update(SPECIAL_TOKENS)
    return vocab, merges


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The dummy model's tokenizer, with ChatML chat template and EOS <|endoftext|>."""
    vocab, merges = _vocab_and_merges()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    eos = next(t for t, i in SPECIAL_TOKENS.items() if i == EOS_TOKEN_ID)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token=eos,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
