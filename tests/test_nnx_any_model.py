"""Any nnx model in FP8 through `convert_to_fp8(..., example_inputs=...)`: the dots its modules
call themselves (fp8jax.flax.nnx_dots).

The model is plain nnx, written without fp8jax: GPT-2's Conv1D (a `lax.dot_general` on its
own kernel), attention as `jnp.einsum`, dropout, and an output projection tied to the
embedding as an einsum. References: the same model unconverted (parameters, bf16 training),
numpy (recorded amaxes) and fp8jax's `fp8_dot_general`.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import fp8jax
from fp8jax.deviceless import deviceless_toolchain_missing
from fp8jax.flax import Fp8Rule, convert_to_fp8, nnx_value_and_grad
from fp8jax.flax.nnx import Fp8MetaVariable

VOCAB, WIDTH, HEADS, SEQ, BATCH = 64, 32, 2, 16, 2
ALL = (Fp8Rule(),)


class Conv1D(nnx.Module):
  def __init__(self, din, dout, rngs):
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), (dout, din)) * 0.02)
    self.bias = nnx.Param(jnp.zeros((dout,)))

  def __call__(self, x):
    kernel = self.kernel[...].T
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))) + self.bias[...]


class Block(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.qkv, self.out = Conv1D(WIDTH, 3 * WIDTH, rngs), Conv1D(WIDTH, WIDTH, rngs)
    self.up, self.down = Conv1D(WIDTH, 2 * WIDTH, rngs), Conv1D(2 * WIDTH, WIDTH, rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    h = self.norm(x)
    q, k, v = (t.reshape(x.shape[:2] + (HEADS, WIDTH // HEADS))
               for t in jnp.split(self.qkv(h), 3, -1))
    weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(WIDTH // HEADS))
    x = x + self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape))
    return x + self.dropout(self.down(nnx.gelu(self.up(x))))


class LanguageModel(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.blocks = nnx.List([Block(rngs), Block(rngs)])

  def __call__(self, ids):
    x = self.embed(ids)
    for block in self.blocks:
      x = block(x)
    return jnp.einsum("bsd,vd->bsv", x, self.embed.embedding[...])  # tied head


def _ids(seed, batch=BATCH):
  return jax.random.randint(jax.random.key(seed), (batch, SEQ), 0, VOCAB)


def _loss(model, ids):
  logits = model(ids).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(ids, -1, 1)).mean()


def _train(model, steps, fp8):
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  ids = _ids(0)

  @nnx.jit
  def step(model, optimizer):
    if fp8:
      loss, grads = nnx_value_and_grad(_loss)(model, ids)
    else:
      loss, grads = nnx.value_and_grad(_loss)(model, ids)
    optimizer.update(model, grads)
    return loss

  return [float(step(model, optimizer)) for _ in range(steps)]


def _paths(report):
  return ["/".join(map(str, row.path)) for row in report.rows]


def test_every_dot_is_converted_and_the_params_are_unchanged():
  model = LanguageModel(nnx.Rngs(0))
  before = nnx.state(model, nnx.Param)
  report = convert_to_fp8(model, rules=ALL, example_inputs=(_ids(0),), report=True)
  expected = []
  for i in range(2):
    expected += [f"blocks/{i}/qkv/dot_general_0", f"blocks/{i}/einsum_0",
                 f"blocks/{i}/einsum_1", f"blocks/{i}/out/dot_general_0",
                 f"blocks/{i}/up/dot_general_0", f"blocks/{i}/down/dot_general_0"]
  assert _paths(report) == expected + ["einsum_0"]
  assert len(report.converted) == 13
  after = nnx.state(model, nnx.Param)
  assert jax.tree.structure(after) == jax.tree.structure(before)
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
  fp8_state = nnx.state(model, Fp8MetaVariable)
  assert len(jax.tree.leaves(fp8_state, is_leaf=lambda v: isinstance(v, fp8jax.DotMeta))) == 13


def test_a_converted_dot_computes_what_fp8_dot_general_computes_and_records_its_amaxes():
  layer = Conv1D(WIDTH, 48, nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, WIDTH), jnp.float32)
  assert convert_to_fp8(layer, rules=ALL, example_inputs=(x,)) == (("dot_general_0",),)
  meta = layer.fp8_dot_states.dot_general_0.get_value()
  expected, expected_meta = fp8jax.fp8_dot_general(x, layer.kernel[...].T, meta,
                                                   (((2,), (0,)), ((), ())))
  np.testing.assert_array_equal(layer(x), expected + layer.bias[...])
  recorded = layer.fp8_dot_states.dot_general_0.get_value()
  for a, b in zip(jax.tree.leaves(recorded), jax.tree.leaves(expected_meta)):
    np.testing.assert_array_equal(a, b)
  # In evaluation mode the stored scales are used and nothing is recorded.
  layer.eval()
  layer(2 * x)
  for a, b in zip(jax.tree.leaves(layer.fp8_dot_states.dot_general_0.get_value()),
                  jax.tree.leaves(recorded)):
    np.testing.assert_array_equal(a, b)


def test_the_model_trains_20_steps_in_fp8_next_to_bf16():
  bf16_losses = _train(LanguageModel(nnx.Rngs(0)), 20, fp8=False)
  model = LanguageModel(nnx.Rngs(0))
  convert_to_fp8(model, rules=ALL, example_inputs=(_ids(0),))
  fp8_losses = _train(model, 20, fp8=True)
  assert fp8_losses[-1] < 0.75 * fp8_losses[0] and bf16_losses[-1] < 0.75 * bf16_losses[0]
  # As for linen (tests/test_flax_any_model.py): E4M3's 2^-4 relative rounding moves the
  # trajectory by a few percent over 20 steps; a GEMM without its descale is off by far more.
  np.testing.assert_allclose(fp8_losses[-1], bf16_losses[-1], rtol=0.08)
  x_amax = model.blocks[0].qkv.fp8_dot_states.dot_general_0.get_value().x.amax_history
  assert float(x_amax[0]) > 0  # recorded in training


def test_rules_give_two_recipes_and_retracing_keeps_the_state_names():
  model = LanguageModel(nnx.Rngs(0))
  rules = (Fp8Rule(op="einsum", recipe=None),
           Fp8Rule(path=r"blocks/\d+/(up|down)", recipe=fp8jax.CurrentScaling()),
           Fp8Rule(path="blocks/.*"))
  paths = convert_to_fp8(model, rules=rules, example_inputs=(_ids(0),))
  assert len(paths) == 8 and not any("einsum" in str(path[-1]) for path in paths)
  block = model.blocks[1]
  assert block.up.fp8_dot_states.dot_general_0.get_value().recipe == fp8jax.CurrentScaling()
  assert block.qkv.fp8_dot_states.dot_general_0.get_value().recipe == fp8jax.DelayedScaling()
  assert not hasattr(block, "fp8_dot_states")  # its einsums stay in high precision
  structure = jax.tree.structure(nnx.state(model, Fp8MetaVariable))
  _train(model, 2, fp8=True)
  nnx.jit(lambda model, ids: model(ids))(model, _ids(3, batch=3))  # another batch: retraced
  assert jax.tree.structure(nnx.state(model, Fp8MetaVariable)) == structure


_MISSING = deviceless_toolchain_missing()


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
def test_on_h100_every_converted_dot_of_an_nnx_model_is_three_fp8_cublaslt_gemms():
  model = LanguageModel(nnx.Rngs(0))
  converted = convert_to_fp8(model, rules=ALL, example_inputs=(_ids(0),))
  model.eval()  # no dropout; then FP8 recording back on
  model.set_attributes(use_running_average=False, raise_if_not_found=False)
  graphdef, params, fp8_state, rest = nnx.split(model, nnx.Param, Fp8MetaVariable, ...)
  params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16), params)

  def step(params, fp8_state, rest, ids):
    def loss_fn(params, fp8_state):
      model = nnx.merge(graphdef, params, fp8_state, rest)
      return _loss(model, ids), nnx.state(model, Fp8MetaVariable)
    return fp8jax.value_and_grad(loss_fn)(params, fp8_state)

  report = fp8jax.lowering.inspect(step, params, fp8_state, rest,
                                   jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32),
                                   target="deviceless", ptx=False,
                                   compiler_options=fp8jax.lowering.CUBLAS_ONLY_OPTIONS)
  # fprop, dgrad and wgrad of each dot: the first block reads the embedding, a parameter.
  assert report.num_fp8 == 3 * len(converted), str(report)
  assert not report.not_fp8(), str(report)
