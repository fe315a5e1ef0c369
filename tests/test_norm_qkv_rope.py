"""The qkv projection's output gradient cast straight from dq, dk and dv (RoPE's transpose
in the cast's prologue, `pallas_kernels.rotary_gradient`), and the op that uses it,
`fp8jax.ops.norm_qkv_rope.fp8_rms_norm_qkv_rope`.

References, each independent of the kernel: JAX's own transpose of RoPE (autodiff of
`fp8jax.ops.rotary.rope`), float64 numpy, and the unfused composition
`fp8_rms_norm_dense` + RoPE on the jnp path. The kernel runs in the Pallas interpreter;
the tests marked `hopper` compile for an H100 without a GPU.
"""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bitwise import assert_bitwise
import fp8jax
from fp8jax import deviceless
from fp8jax.lowering.compile import compile_text
from fp8jax.lowering.hlo_text import parse_hlo_module
from fp8jax.lowering.inspection import CUBLAS_ONLY_OPTIONS, inspect_hlo
from fp8jax.ops.norm_dense import fp8_rms_norm_dense
from fp8jax.ops.norm_qkv_rope import fp8_rms_norm_qkv_rope
from fp8jax.ops.rotary import frequencies, rope, split_qkv_rope
from pallas_kernels import (CastTransposeBlockSizes, cast_transpose_amax_in_chain,
                            cast_transpose_amax_in_chain_reference)
from pallas_kernels.activations import RMS_NORM
from pallas_kernels.rotary_gradient import qkv_gradient, rotary_qkv_gradient

E5M2 = jnp.float8_e5m2
BASE = 10000.0
# Rows 2 sequences of 50, tiles of 16 rows: a partial last row tile.
BATCH, SEQ, HEADS = 2, 50, 3
BLOCKS = CastTransposeBlockSizes(block_rows=16)

_MISSING = deviceless.deviceless_toolchain_missing()


def _rng(*key) -> np.random.Generator:
  return np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))


def _gradients(rng, head_dim: int, rows: int = BATCH * SEQ):
  """dq, dk, dv [rows, HEADS * head_dim] in bf16, magnitudes spread over 2**-6 .. 2**6,
  with some +0 and -0 (a turned pair of zeros, and v's zeros, come out +0 from autodiff)."""
  shape = (rows, HEADS * head_dim)

  def one():
    t = rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 7, shape)
    t[rng.random(shape) < 0.05] = 0.0
    t[rng.random(shape) < 0.05] = -0.0
    t[3] = -0.0  # a whole row: both halves of every pair are -0
    return jnp.asarray(t, jnp.bfloat16)

  return one(), one(), one()


def _rotary_inputs(head_dim: int, rows: int = BATCH * SEQ):
  """(positions [rows, 1], frequencies [1, HEADS * head_dim]) as the op makes them."""
  positions = (jnp.arange(rows) % SEQ).astype(jnp.float32)[:, None]
  theta = frequencies(head_dim, BASE)
  return positions, jnp.tile(jnp.concatenate([theta, theta]), HEADS)[None, :]


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("accumulate", ["in_place", "accumulator"])
def test_the_rotary_cast_is_bitwise_its_definition(head_dim, accumulate):
  dq, dk, dv = _gradients(_rng("cast", head_dim, accumulate), head_dim)
  args = dict(fp8_dtype=E5M2, fp8_max=57344.0, prologue=rotary_qkv_gradient(head_dim, jnp.bfloat16),
              prologue_inputs=(dk, dv, *_rotary_inputs(head_dim)), descale=jnp.float32(0.25),
              partner_descales=(jnp.float32(3.0), jnp.float32(0.5)), block_sizes=BLOCKS)
  if accumulate == "accumulator":
    args["accumulator"] = jnp.float32(0.0)
  # A running amax below the gradients' own: the result must come from them.
  got = cast_transpose_amax_in_chain(dq, jnp.float32(2.0), jnp.float32(1e-3), interpret=True,
                                     **args)
  want = cast_transpose_amax_in_chain_reference(dq, jnp.float32(2.0), jnp.float32(1e-3), **args)
  assert got.q.shape == (BATCH * SEQ, 3 * HEADS * head_dim) and got.q_t.shape == got.q.shape[::-1]
  assert_bitwise(got, want)
  # The amax is that of the stacked gradient: the turned dq and dk, and dv as it is.
  stacked = qkv_gradient(*(t.astype(jnp.float32) for t in (dq, dk, dv)),
                         *_rotary_inputs(head_dim), head_dim=head_dim, dtype=jnp.bfloat16)
  assert float(got.amax) == float(jnp.max(jnp.abs(stacked))) > 1e-3


def test_the_definition_is_jax_s_transpose_of_rope_and_near_float64():
  head_dim = 64
  dq, dk, dv = _gradients(_rng("definition"), head_dim)
  got = qkv_gradient(*(t.astype(jnp.float32) for t in (dq, dk, dv)), *_rotary_inputs(head_dim),
                     head_dim=head_dim, dtype=jnp.bfloat16)

  # JAX's transpose of the forward the GPT runs: bit for bit (the same products, rounded
  # to bf16 where autodiff rounds).
  qkv = jnp.zeros((BATCH, SEQ, HEADS, 3, head_dim), jnp.bfloat16)
  _, transpose = jax.vjp(lambda t: split_qkv_rope(t, BASE), qkv)
  as_heads = lambda t: t.reshape(BATCH, SEQ, HEADS, head_dim)
  (want,) = transpose(tuple(map(as_heads, (dq, dk, dv))))
  assert_bitwise(got, want.reshape(got.shape).astype(jnp.float32))

  # float64: dx_i = g_i cos + g_{i+D/2} sin, dx_{i+D/2} = g_{i+D/2} cos - g_i sin. The
  # final rounding to bf16 (8 significant bits) is off by at most 2**-8 relative; before it, the
  # float32 angle of position up to 49 is off by up to 49 * 2**-24 (2**-18.4), and so are
  # its cos and sin, times the pair's largest gradient: 2**-16 of it bounds that 5x over.
  half = head_dim // 2
  theta = np.asarray(frequencies(head_dim, BASE), np.float64)
  angle = (np.arange(BATCH * SEQ) % SEQ)[:, None, None] * theta
  cos, sin = np.cos(angle), np.sin(angle)
  g = np.asarray(dq, np.float64).reshape(-1, HEADS, 2, half)
  want64 = np.concatenate([g[:, :, 0] * cos + g[:, :, 1] * sin,
                           g[:, :, 1] * cos - g[:, :, 0] * sin], axis=-1)
  got_q = np.asarray(got, np.float64).reshape(-1, HEADS, 3, head_dim)[:, :, 0]
  scale = np.abs(g).max(axis=2).max(axis=-1, keepdims=True)
  np.testing.assert_array_less(np.abs(got_q - want64), 2.0**-8 * np.abs(want64)
                               + 2.0**-16 * scale + 1e-30)
  got_v = np.asarray(got, np.float64).reshape(-1, HEADS, 3, head_dim)[:, :, 2]
  np.testing.assert_array_equal(got_v, np.asarray(dv, np.float64).reshape(-1, HEADS, head_dim))


def test_a_nan_in_dk_makes_the_amax_nan_and_shapes_are_checked():
  head_dim = 32
  dq, dk, dv = _gradients(_rng("nan"), head_dim)
  dk = dk.at[7, 40].set(jnp.nan)
  prologue = rotary_qkv_gradient(head_dim, jnp.bfloat16)
  args = dict(fp8_dtype=E5M2, fp8_max=57344.0, prologue=prologue, block_sizes=BLOCKS)
  got = cast_transpose_amax_in_chain(dq, jnp.float32(1.0), jnp.float32(1.0), interpret=True,
                                     prologue_inputs=(dk, dv, *_rotary_inputs(head_dim)), **args)
  assert np.isnan(float(got.amax))
  with pytest.raises(ValueError, match="positions, frequencies"):
    cast_transpose_amax_in_chain(dq, jnp.float32(1.0), jnp.float32(1.0), interpret=True,
                                 prologue_inputs=(dk, dv, *_rotary_inputs(head_dim)[::-1]), **args)
  with pytest.raises(ValueError, match="head_dim=48"):
    cast_transpose_amax_in_chain(dq[:, :96], jnp.float32(1.0), jnp.float32(1.0), interpret=True,
                                 prologue_inputs=(dk[:, :96], dv[:, :96], _rotary_inputs(32)[0],
                                                  jnp.ones((1, 96))),
                                 **dict(args, prologue=rotary_qkv_gradient(48, jnp.bfloat16)))
  with pytest.raises(ValueError, match="even"):
    rotary_qkv_gradient(33, jnp.bfloat16)


def _problem(head_dim: int = 64, d_model: int = 128, recipe=fp8jax.DelayedScaling()):
  rng = _rng("op", head_dim, d_model)
  x = jnp.asarray(rng.standard_normal((BATCH, SEQ, d_model)) * 3.0, jnp.bfloat16)
  scale = jnp.asarray(1.0 + 0.1 * rng.standard_normal(d_model), jnp.float32)
  kernel = jnp.asarray(0.05 * rng.standard_normal((d_model, HEADS, 3, head_dim)), jnp.float32)
  cotangents = tuple(jnp.asarray(rng.standard_normal((BATCH, SEQ, HEADS, head_dim)), jnp.bfloat16)
                     for _ in range(3))
  meta = fp8jax.init_dot_meta(recipe)
  return x, scale, kernel, meta, cotangents


def _fused(x, scale, kernel, meta, save_fp8=False):
  return fp8_rms_norm_qkv_rope(x, scale, kernel, meta, rope_base=BASE, save_fp8=save_fp8)


def _composed(x, scale, kernel, meta, save_fp8=False):
  y, new_meta = fp8_rms_norm_dense(x, scale, kernel, meta, save_fp8=save_fp8)
  return split_qkv_rope(y, BASE), new_meta


def _step(op, cotangents, save_fp8):
  """(q, k, v), the new meta, and the gradients of <(q, k, v), cotangents> with respect to
  x, the gains, the kernel and the meta (its cotangent carries the recorded amaxes)."""
  def loss(x, scale, kernel, meta):
    (q, k, v), new_meta = op(x, scale, kernel, meta, save_fp8)
    total = sum(jnp.sum(a.astype(jnp.float32) * c.astype(jnp.float32))
                for a, c in zip((q, k, v), cotangents))
    return total, ((q, k, v), new_meta)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


@pytest.mark.parametrize("save_fp8,recipe", [
    (False, fp8jax.DelayedScaling()), (True, fp8jax.DelayedScaling()),
    (False, fp8jax.CurrentScaling())], ids=["bf16_saved", "fp8_saved", "current"])
def test_the_op_is_the_composition_bit_for_bit_on_the_kernel_path_and_the_jnp_path(
    save_fp8, recipe, request):
  """Under current scaling the gradient's cast makes its scale from the amax of the
  stacked gradient, reduced from dq, dk, dv before it."""
  x, scale, kernel, meta, cotangents = _problem(recipe=recipe)
  want = _step(_composed, cotangents, save_fp8)(x, scale, kernel, meta)
  jnp_path = _step(_fused, cotangents, save_fp8)(x, scale, kernel, meta)
  assert_bitwise(jnp_path, want)
  request.getfixturevalue("interpreted_kernels")  # the kernels chosen on CPU, interpreted
  kernel_path = _step(_fused, cotangents, save_fp8)(x, scale, kernel, meta)
  assert_bitwise(kernel_path, want)
  grads, _ = kernel_path
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in grads[:3])
  # The gradient's amax is recorded (the cast saw dq, dk, dv).
  assert float(grads[3].grad.amax) > 0


def test_under_current_scaling_the_casts_make_the_norm_and_the_rotary_gradient(
    reduced_prologues):
  """The fused form runs under current scaling too: the forward cast makes the norm and
  the backward's the stacked qkv gradient from dq, dk, dv, each after a reduction of that
  function's amax."""
  x, scale, kernel, meta, cotangents = _problem(recipe=fp8jax.CurrentScaling())
  _step(_fused, cotangents, False)(x, scale, kernel, meta)
  assert [p.rotary for p in reduced_prologues] == [None, 64], reduced_prologues
  assert reduced_prologues[0] is RMS_NORM


def test_bad_inputs_name_the_argument():
  x, scale, kernel, meta, _ = _problem()
  with pytest.raises(ValueError, match=r"kernel \[D, heads, 3, head_dim\]"):
    fp8_rms_norm_qkv_rope(x, scale, kernel[:, :, :2], meta, rope_base=BASE)
  with pytest.raises(ValueError, match="rope_base"):
    fp8_rms_norm_qkv_rope(x, scale, kernel, meta, rope_base=0.0)
  with pytest.raises(ValueError, match="head_dim=63"):
    fp8_rms_norm_qkv_rope(x, scale, kernel[..., :63], meta, rope_base=BASE)


def test_a_head_the_kernel_does_not_tile_runs_the_composition():
  # head_dim 48: not a power of two, so no kernel tile; the same numbers by the composition.
  x, scale, kernel, meta, cotangents = _problem(head_dim=48)
  with pytest.warns(UserWarning, match="head_dim=48 is not one of"):
    fused = _step(_fused, cotangents, False)(x, scale, kernel, meta)
  assert_bitwise(fused,
                 _step(_composed, cotangents, False)(x, scale, kernel, meta))


@pytest.mark.hopper
@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
@pytest.mark.parametrize("op", ["fused", "composed"])
def test_h100_backward_casts_dq_dk_dv_without_writing_their_stack(op):
  """Deviceless H100: the fused op's backward runs one cast kernel on dq, dk, dv and no
  kernel writes the stacked bf16 qkv gradient; the composition (the control) writes it."""
  batch, seq, d_model, head_dim = 4, 512, 512, 64
  heads = d_model // head_dim
  f = {"fused": _fused, "composed": _composed}[op]

  def loss(x, scale, kernel, meta):
    (q, k, v), _ = f(x, scale, kernel, meta)
    # A stand-in for attention that keeps dq, dk and dv distinct arrays.
    return jnp.sum((q.astype(jnp.float32) * k.astype(jnp.float32)) * v.astype(jnp.float32))

  shapes = (jax.ShapeDtypeStruct((batch, seq, d_model), jnp.bfloat16),
            jax.ShapeDtypeStruct((d_model,), jnp.float32),
            jax.ShapeDtypeStruct((d_model, heads, 3, head_dim), jnp.float32),
            jax.eval_shape(lambda: fp8jax.init_dot_meta(fp8jax.DelayedScaling())))
  with jax.set_mesh(deviceless.h100_mesh(x=1)):
    hlo = compile_text(jax.grad(loss, argnums=(0, 1, 2, 3)), *shapes,
                       compiler_options=dict(CUBLAS_ONLY_OPTIONS), target="deviceless",
                       collect_ptx=False).hlo
  rows, stacked = batch * seq, 3 * d_model
  module = parse_hlo_module(hlo)
  writes_stack = [i.name for c in module.computations.values() if c.is_entry
                  for i in c.instructions.values() if i.opcode == "fusion"
                  and any(s.dtype == "bf16" and s.dims in ((rows, stacked),
                                                           (batch, seq, heads, 3, head_dim))
                          for s in i.shapes)]
  rotary_casts = [i for c in module.computations.values() if c.is_entry
                  for i in c.instructions.values() if i.opcode == "custom-call"
                  and "cast_transpose_amax" in i.attributes.get("metadata", "")
                  and any(s.dims == (rows, stacked) and s.dtype == "f8e5m2" for s in i.shapes)]
  assert len(rotary_casts) == 1, hlo
  assert all(g.target == "__cublas$lt$matmul$f8" for g in inspect_hlo(hlo).gemms if g.runs_in_fp8)
  entry = next(c for c in module.computations.values() if c.is_entry).instructions
  read = [entry[name].shape for name in rotary_casts[0].operands if name in entry]
  per_head = sum(s is not None and s.dtype == "bf16" and s.dims == (rows, d_model) for s in read)
  if op == "fused":
    assert not writes_stack, writes_stack
    assert per_head == 3, read  # dq, dk and dv themselves
  else:
    assert writes_stack and per_head == 0, read



def test_the_flax_layer_takes_an_fp8_dense_general_s_variables_and_gives_its_numbers():
  from fp8jax.flax.linen import Fp8DenseGeneral
  from fp8jax.flax.linen_qkv import Fp8NormQkvRope

  x, scale, _, _, _ = _problem()
  dense = Fp8DenseGeneral(features=(HEADS, 3, 64), use_bias=False, dtype=jnp.bfloat16)
  variables = dense.init(jax.random.key(0), x, norm_scale=scale)
  layer = Fp8NormQkvRope(heads=HEADS, head_dim=64, rope_base=BASE, dtype=jnp.bfloat16)
  assert jax.tree.structure(layer.init(jax.random.key(0), x, norm_scale=scale)) == \
      jax.tree.structure(variables)
  got, got_state = layer.apply(variables, x, norm_scale=scale, mutable=["fp8_meta"])
  y, want_state = dense.apply(variables, x, norm_scale=scale, mutable=["fp8_meta"])
  assert_bitwise((got, got_state), (split_qkv_rope(y, BASE), want_state))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_compiled_rotary_cast_is_bitwise_its_definition_on_hopper(head_dim, hopper_device):
  """The Triton kernel against the jnp definition run by XLA on the same GPU: their cos and
  sin (libdevice's on both sides) and their float32 sums must round alike."""
  dq, dk, dv = jax.device_put(_gradients(_rng("gpu", head_dim), head_dim), hopper_device)
  positions, per_column = jax.device_put(_rotary_inputs(head_dim), hopper_device)
  args = dict(fp8_dtype=E5M2, fp8_max=57344.0,
              prologue=rotary_qkv_gradient(head_dim, jnp.bfloat16),
              prologue_inputs=(dk, dv, positions, per_column))
  got = jax.jit(lambda *a: cast_transpose_amax_in_chain(*a, **args))(
      dq, jnp.float32(2.0), jnp.float32(1e-3))
  want = jax.jit(lambda *a: cast_transpose_amax_in_chain_reference(*a, **args))(
      dq, jnp.float32(2.0), jnp.float32(1e-3))
  assert_bitwise(got, want)
