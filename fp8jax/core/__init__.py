"""FP8 numerics and state: the bottom layer of fp8jax.

* `formats`: E4M3 and E5M2, and the format choices ("hybrid", "e4m3").
* `validation`: the argument checks shared by public functions.
* `quantize`: per-tensor numerics: the saturating cast, the amax (exact, NaN wins),
  the scale an amax gives, power-of-two rounding.
* `blocks`: per-row / per-block / MX quantization and the GEMMs of such operands.
* `recipes`: the `Recipe` protocol and the built-in recipes.
* `meta`: `Fp8Meta`, `DotMeta`, `AttentionMeta`: making, checking, mapping and
  resizing them, recording an amax, the scale for a cast, the descale.

May import: JAX and `pallas_kernels` (the block-scaled GEMM kernel). Imports no
other fp8jax layer (no mesh, ops, step, Flax): what needs the mesh or a trace is
done by the layers above, which call down into this one.
"""
