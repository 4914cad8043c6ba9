"""`byte_tokenizer()`: UTF-8 bytes as tokens (id = byte value, vocabulary 256) as a transformers fast
tokenizer, the same ids as the ``text`` task's default tokenizer (`polyattn.tasks.text`), so a model
trained on bytes can be saved with a tokenizer and evaluated by tools that need one (lm-eval).

Byte-level BPE with no merges: every byte is one token. The byte -> printable-character table is the
usual byte-level one (printable Latin-1 bytes stand for themselves, the others are shifted past 255).
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BYTE_VOCAB = 256


def byte_characters():
    """``[256]`` the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(BYTE_VOCAB)]


def byte_tokenizer():
    """A `PreTrainedTokenizerFast` whose ids are the UTF-8 bytes of the text."""
    vocab = {c: b for b, c in enumerate(byte_characters())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)
