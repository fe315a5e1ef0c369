"""Flax's stock layers keep working once converted to FP8.

`nnx.MultiHeadAttention` calls its projections with `out_sharding=`; `nnx.Einsum` may take
its equation at call time. A replacement layer must accept every call argument the layer it
replaces accepts. References: the unconverted model (outputs, losses, gradients) and
Flax's own call signatures (`inspect.signature`).
"""
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
from fp8jax.flax import Fp8Rule, convert_to_fp8, nnx_value_and_grad
from fp8jax.flax import linen as fp8_linen
from fp8jax.flax import nnx as fp8_nnx

# Wide enough that the default filter converts every projection (K = N = 2048: the cost
# model predicts 1.30x at 4096 tokens); short sequences keep the emulated FP8 GEMMs cheap on a CPU.
WIDTH, HEADS = 2048, 4
X_SHAPE = (2, 8, WIDTH)


class StockBlock(nnx.Module):
  """A block built only from Flax's stock layers."""

  def __init__(self, rngs):
    self.attention = nnx.MultiHeadAttention(num_heads=HEADS, in_features=WIDTH, decode=False,
                                            rngs=rngs)
    self.up = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.heads = nnx.LinearGeneral(WIDTH, (HEADS, WIDTH // HEADS), rngs=rngs)
    self.down = nnx.Einsum("bshk,hkd->bsd", (HEADS, WIDTH // HEADS, WIDTH), rngs=rngs)
    # Called with another equation than its own (the call's wins, as nnx.Einsum reads it).
    self.mix = nnx.Einsum("bsd,de->bse", (WIDTH, WIDTH), rngs=rngs)

  def __call__(self, x):
    x = x + self.attention(x)
    x = x + self.down(self.heads(jax.nn.gelu(self.up(x))))
    return self.mix(x, "bsd,ed->bse")


PROJECTIONS = {("attention", name) for name in ("query", "key", "value", "out")}
LAYERS = PROJECTIONS | {("up",), ("heads",), ("down",), ("mix",)}


def _x():
  return jax.random.normal(jax.random.key(1), X_SHAPE, jnp.float32)


def _loss(model, x):
  return jnp.mean(model(x) ** 2)


def _rel_error(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


# Each E4M3 quantization rounds to 3 mantissa bits: relative error at most 2**-4 per
# element, RMS 2**-4 / sqrt(3) ~ 0.036 for uniformly spread rounding. A GEMM of two
# quantized operands has RMS relative error ~ sqrt(2) * 0.036 = 0.051; the block chains up
# to 4 GEMMs (v, out, up/heads/down, mix) and the residual sums carry half the signal
# unquantized, so the output's relative error stays below ~0.1: 0.15 leaves room for
# random spread and fails on any real mistake (a wrong transpose or scale gives ~1).
OUTPUT_TOLERANCE = 0.15
# Gradients pass E5M2 (2 mantissa bits: RMS 2**-3 / sqrt(3) ~ 0.072) through the same
# chain, roughly doubling the error: 0.3.
GRADIENT_TOLERANCE = 0.3


@pytest.mark.parametrize("example_inputs", [False, True], ids=["layers", "with_dots"])
@pytest.mark.parametrize("accept_all", [False, True], ids=["default_filter", "accept_all"])
def test_stock_block_converts_and_trains_like_the_unconverted_model(accept_all,
                                                                    example_inputs):
  x = _x()
  reference = StockBlock(nnx.Rngs(0))
  model = StockBlock(nnx.Rngs(0))
  options = {}
  if accept_all:
    options["rules"] = (Fp8Rule(),)
  if example_inputs:
    options["example_inputs"] = (jax.ShapeDtypeStruct(X_SHAPE, jnp.float32),)
  with _quiet():
    report = convert_to_fp8(model, report=True, **options)
  converted = {row.path for row in report.converted}
  assert LAYERS <= converted, report
  # The attention's own products run in jax.nn.dot_product_attention, which no
  # conversion reaches (fp8jax.flax.op_routing): exactly the layers are candidates.
  assert {row.path for row in report.rows} == LAYERS, report
  assert isinstance(model.attention.query, fp8_nnx.Fp8LinearGeneral)

  want_y, got_y = reference(x), model(x)
  assert _rel_error(got_y, want_y) < OUTPUT_TOLERANCE

  want_loss, want_grads = nnx.value_and_grad(_loss)(reference, x)
  step = nnx.jit(nnx_value_and_grad(_loss))
  loss, grads = step(model, x)
  assert abs(float(loss) - float(want_loss)) / float(want_loss) < 2 * OUTPUT_TOLERANCE
  for path, want in nnx.to_flat_state(want_grads):
    if path == ("attention", "key", "bias"):
      # Zero in exact arithmetic (q . b_k shifts a query's logits equally, and softmax
      # ignores a shift): both sides hold float32 rounding noise of ~1e-10 only.
      continue
    got = dict(nnx.to_flat_state(grads))[path]
    assert _rel_error(got.get_value(), want.get_value()) < GRADIENT_TOLERANCE, path
  # The step recorded amaxes: the query projection's x amax is max |x| of this step.
  meta = model.attention.query.fp8_meta.get_value()
  np.testing.assert_allclose(float(meta.x.amax_history[0]), float(jnp.max(jnp.abs(x))),
                             rtol=0)


class _quiet:
  """Conversion warns about dots that stay high precision; these tests read the report."""

  def __enter__(self):
    import warnings
    self._catch = warnings.catch_warnings()
    self._catch.__enter__()
    warnings.simplefilter("ignore")
    return self

  def __exit__(self, *exc):
    return self._catch.__exit__(*exc)


# ----- call signatures against Flax's own ---------------------------------------------

REPLACEMENTS = [
    (fp8_nnx.Fp8Linear, nnx.Linear),
    (fp8_nnx.Fp8LinearGeneral, nnx.LinearGeneral),
    (fp8_nnx.Fp8Einsum, nnx.Einsum),
    (fp8_linen.Fp8Dense, nn.Dense),
    (fp8_linen.Fp8DenseGeneral, nn.DenseGeneral),
    (fp8_linen.Fp8Einsum, nn.Einsum),
    (fp8_linen.Fp8DotGeneral, jax.lax.dot_general),
]


def _call_parameters(layer):
  target = layer if inspect.isfunction(layer) else layer.__call__
  parameters = list(inspect.signature(target).parameters.values())
  return [p for p in parameters if p.name != "self"]


@pytest.mark.parametrize("fp8_layer,flax_layer", REPLACEMENTS,
                         ids=[f.__name__ for f, _ in REPLACEMENTS])
def test_fp8_layer_accepts_every_call_argument_of_the_flax_layer(fp8_layer, flax_layer):
  """Same names, same kinds (positional / keyword), same defaults, in the same order: a
  new keyword in a Flax release fails here instead of in a user's model."""
  ours = {p.name: p for p in _call_parameters(fp8_layer)}
  theirs = _call_parameters(flax_layer)
  missing = [p.name for p in theirs if p.name not in ours]
  assert not missing, f"{fp8_layer.__name__} lacks {missing} of {flax_layer.__name__}"
  for position, p in enumerate(theirs):
    mine = ours[p.name]
    assert mine.kind == p.kind, (p.name, mine.kind, p.kind)
    assert (mine.default is inspect.Parameter.empty) == (p.default is inspect.Parameter.empty)
    if p.default is not inspect.Parameter.empty:
      assert mine.default == p.default, (p.name, mine.default, p.default)
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
      assert list(ours).index(p.name) == position, (p.name, list(ours))


def test_nnx_fp8_einsum_takes_the_call_equation_over_its_own():
  x = _x()[..., :64]
  kernel_shape = (64, 64)
  theirs = nnx.Einsum("bsd,de->bse", kernel_shape, rngs=nnx.Rngs(0))
  ours = fp8_nnx.Fp8Einsum("bsd,de->bse", kernel_shape, rngs=nnx.Rngs(0))
  ours.kernel = theirs.kernel
  for equation in (None, "bsd,ed->bse"):
    assert _rel_error(ours(x, equation), theirs(x, equation)) < OUTPUT_TOLERANCE, equation
  without = fp8_nnx.Fp8Einsum(None, kernel_shape, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="no einsum_str"):
    without(x)


def test_linen_fp8_einsum_takes_a_call_time_equation_like_nn_einsum():
  x = _x()[..., :64]
  ours = fp8_linen.Fp8Einsum(shape=(64, 32), recipe=fp8jax.DelayedScaling())
  theirs = nn.Einsum(shape=(64, 32), use_bias=False)
  variables = ours.init(jax.random.key(0), x, "bsd,de->bse")
  their_variables = {"params": variables["params"]}
  y, _ = ours.apply(variables, x, "bsd,de->bse", mutable=["fp8_meta"])
  want = theirs.apply(their_variables, x, "bsd,de->bse")
  assert _rel_error(y, want) < OUTPUT_TOLERANCE
