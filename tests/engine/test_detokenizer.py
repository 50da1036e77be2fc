"""Incremental detokenization against decoding the whole text at once, on a SentencePiece-style
(Metaspace) tokenizer, where a token's leading space depends on what comes before it."""

from __future__ import annotations

from fivefold.engine.detokenizer import IncrementalDetokenizer
from fivefold.models.tokenizer import Tokenizer


def _metaspace_tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["The", "capital", "of", "France", "is", "Paris", ".", "It", "has", "caf\u00e9s"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"\u2581{w}": i + 3 for i, w in enumerate(words)}}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()  # strips the space of the first token of a text, as SentencePiece does
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>"))


def test_streamed_text_keeps_the_first_tokens_leading_space_and_equals_the_whole_decode():
    tokenizer = _metaspace_tokenizer()
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    output = tokenizer.encode("Paris . It has cafés", add_special_tokens=False)
    assert 0 not in prompt + output  # every word is in the vocabulary
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    streamed = "".join(detok.add([t]) for t in output)
    whole = tokenizer.decode(prompt + output)
    assert streamed == whole[len(tokenizer.decode(prompt)):] == " Paris . It has cafés"
    # Without the prompt's context (as before) the first token loses its space.
    without = "".join(IncrementalDetokenizer(tokenizer).add([t]) for t in output)
    assert not without.startswith(" ") and without != streamed
