"""A checkpoint written by fp8jax 0.1.0 (format version 1) restores into today's layout.

tests/data/checkpoint_v1 was written by fp8jax 0.1.0 after three training steps of
a two-layer model (plus a meta stacked over two layers); checkpoint_v1_values.json
holds the bit patterns of every array it saved. Version 1 stored each Fp8Meta as
(scale, amax_history); version 2 adds scale_inv and the running amax; version 3
adds a checksum of every array.
"""
from __future__ import annotations

import json
import pathlib
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax

ckpt = pytest.importorskip("fp8jax.checkpoint")
DATA = pathlib.Path(__file__).parent / "data"
RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
TX = optax.adam(1e-2)


def _targets():
  params = {"w1": jnp.zeros((32, 48), jnp.float32), "w2": jnp.zeros((48, 16), jnp.float32)}
  one = fp8jax.init_dot_meta(RECIPE)
  fp8_state = {"l1": one, "l2": one, "stacked": jax.tree.map(lambda a: jnp.stack([a, a]), one)}
  return params, TX.init(params), fp8_state


def _saved_bits():
  return json.loads((DATA / "checkpoint_v1_values.json").read_text())


def _bits(tree, item):
  return {jax.tree_util.keystr(path): np.asarray(leaf, np.float32).view(np.uint32).ravel().tolist()
          for path, leaf in jax.tree_util.tree_leaves_with_path({item: tree})}


def test_version_1_checkpoint_restores_bit_exactly_into_the_four_field_layout(tmp_path):
  path = tmp_path / "checkpoint_v1"
  shutil.copytree(DATA / "checkpoint_v1", path)
  assert ckpt.read_description(path)["version"] == 1
  params, opt_state, fp8_state = _targets()
  # Version 1 has no checksums: restore says that its values cannot be verified.
  with pytest.warns(ckpt.UnverifiedCheckpointWarning, match="version 1, written before checksums"):
    restored = ckpt.restore(path, params=params, opt_state=opt_state, fp8_state=fp8_state)
  saved = _saved_bits()
  for item in ("params", "opt_state"):
    got = _bits(restored[item], item)
    assert got == {k: v for k, v in saved.items() if k.startswith(f"['{item}']")}, item
  metas = jax.tree.leaves(restored["fp8_state"], is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta))
  assert len(metas) == 9
  for path_and_meta in jax.tree_util.tree_leaves_with_path(
      restored["fp8_state"], is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta)):
    key, meta = jax.tree_util.keystr(path_and_meta[0]), path_and_meta[1]
    for field in ("scale", "amax_history"):
      want = saved[f"['fp8_state']{key}.{field}"]
      assert np.asarray(getattr(meta, field), np.float32).view(np.uint32).ravel().tolist() == want
    # What end_step would have returned: the reciprocal it computes, no step in progress.
    np.testing.assert_array_equal(np.asarray(meta.scale_inv), np.float32(1) / np.asarray(meta.scale))
    np.testing.assert_array_equal(np.asarray(meta.amax), 0.0)
  # The saved run had real data: scales moved away from their initial 1.
  assert any(float(np.max(m.scale)) != 1.0 for m in metas)


def test_restored_version_1_state_trains_on_and_saves_in_the_current_format(tmp_path):
  path = tmp_path / "checkpoint_v1"
  shutil.copytree(DATA / "checkpoint_v1", path)
  params, opt_state, fp8_state = _targets()
  with pytest.warns(ckpt.UnverifiedCheckpointWarning):
    restored = ckpt.restore(path, params=params, opt_state=opt_state, fp8_state=fp8_state)

  def loss_fn(params, fp8_state, x):
    h, m1 = fp8jax.fp8_dense(x, params["w1"], None, fp8_state["l1"])
    y, m2 = fp8jax.fp8_dense(jax.nn.gelu(h), params["w2"], None, fp8_state["l2"])
    return jnp.mean(y.astype(jnp.float32) ** 2), {"l1": m1, "l2": m2,
                                                  "stacked": fp8_state["stacked"]}

  x = jax.random.normal(jax.random.key(13), (64, 32), jnp.bfloat16)
  loss, grads, state = jax.jit(fp8jax.value_and_grad(loss_fn))(
      restored["params"], restored["fp8_state"], x)
  assert np.isfinite(float(loss))
  # The step pushed its amax of x into l1's history: the old newest entry moved one back.
  np.testing.assert_array_equal(np.asarray(state["l1"].x.amax_history[1:]),
                                np.asarray(restored["fp8_state"]["l1"].x.amax_history[:-1]))
  assert float(state["l1"].x.amax_history[0]) == float(fp8jax.amax(x))
  out = ckpt.save(tmp_path / "resaved", params=restored["params"], opt_state=restored["opt_state"],
                  fp8_state=state)
  assert ckpt.read_description(out)["version"] == ckpt.FORMAT_VERSION == 3
  with warnings.catch_warnings():
    warnings.simplefilter("error", ckpt.UnverifiedCheckpointWarning)  # verified: no warning
    again = ckpt.restore(out, params=params, opt_state=opt_state, fp8_state=fp8_state)
  for a, b in zip(jax.tree.leaves(again["fp8_state"]), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
