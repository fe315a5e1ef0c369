"""Models built from fp8jax's own layers, for demos and end-to-end checks.

`fp8jax.models.gpt`: a byte-level decoder-only transformer that runs in bf16
(`recipe=None`) or with FP8 projections and attention (an fp8jax recipe).
"""
