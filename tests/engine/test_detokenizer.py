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


def test_lone_bytes_are_emitted_as_replacement_characters_not_held_forever(smollm2):
    """A model made to write one lone byte token again and again (logit_bias +100): every decode
    of the window ends in U+FFFD. Before the bound the window grew with every token and no text was
    ever emitted; now the text is the whole decode, but for the last few tokens still pending."""
    from fivefold.llm import LLM
    from fivefold.sampling_params import SamplingParams

    hf = smollm2.tokenizer.hf
    lone = next(t for t in range(0, 1000) if len(hf.convert_ids_to_tokens(t)) == 1
                and hf.decode([t]) == "\ufffd" and hf.decode([t, t]) == "\ufffd\ufffd")
    llm = LLM(smollm2, kv_cache_memory_bytes=16 << 20)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True,
                                                 logit_bias={lone: 100.0}))[0].outputs[0]
    assert out.token_ids == [lone] * 200
    whole = hf.decode(out.token_ids)
    assert whole.startswith(out.text) and len(out.text) >= len(whole) - 8, (len(out.text), len(whole))
