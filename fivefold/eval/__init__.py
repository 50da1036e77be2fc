"""Evaluation: what every lever reports its accuracy and speed with.

    text.py      pydoc_data split into calibration and held-out parts; token windows, prompts
    language.py  LLM perplexity, next-token accuracy, prefill logits, decode tokens/s
    digits.py    the digits image task: data split, training, accuracy
"""
