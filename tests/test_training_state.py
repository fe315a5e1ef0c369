"""FP8 state threading through jitted train steps: amaxes recorded once per step, max over uses."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax

RECIPE = fp8jax.DelayedScaling(amax_history_len=4)


def _newest(meta):
  return {role: float(getattr(meta, role).amax_history[..., 0]) for role in ("x", "kernel", "grad")}


def test_one_jitted_step_records_true_amax_of_x_kernel_and_output_grad():
  kx, kk, kt = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (6, 5, 16))
  params = {"kernel": jax.random.normal(kk, (16, 8)), "bias": jnp.zeros(8)}
  target = 3 * jax.random.normal(kt, (6, 5, 8))
  meta = fp8jax.init_dot_meta(RECIPE)
  meta = jax.tree.map(lambda a: a + 0.5, meta)  # a history with earlier entries

  def loss_fn(params, meta, x):
    y, meta = fp8jax.fp8_dense(x, params["kernel"], params["bias"], meta)
    return jnp.sum(y * target), meta  # dL/dy = target exactly

  _, _, new_meta = jax.jit(fp8jax.value_and_grad(loss_fn))(params, meta, x)
  want = {"x": jnp.max(jnp.abs(x)), "kernel": jnp.max(jnp.abs(params["kernel"])),
          "grad": jnp.max(jnp.abs(target))}
  for role in ("x", "kernel", "grad"):
    history = np.asarray(getattr(new_meta, role).amax_history)
    old = np.asarray(getattr(meta, role).amax_history)
    assert history[0] == np.float32(want[role]), role
    np.testing.assert_array_equal(history[1:], old[:-1])  # advanced by exactly one entry
    # The new scale follows from the window (old entries 0.5 are smaller).
    fmt = getattr(new_meta, role).fmt
    assert float(getattr(new_meta, role).scale) == np.float32(fmt.max) / np.float32(want[role])


def _layer_stack(seed, n_layers=4, width=16):
  keys = jax.random.split(jax.random.key(seed), n_layers + 1)
  # Per-layer gains with the largest in the middle: max != first != last != sum.
  gains = jnp.array([0.5, 3.0, 1.5, 0.25])[:n_layers]
  kernels = jnp.stack([jax.random.normal(k, (width, width)) * g / np.sqrt(width)
                       for k, g in zip(keys[:-1], gains)])
  x = jax.random.normal(keys[-1], (8, width))
  return kernels, x


def _reference_amaxes(kernels, x):
  """Per-layer amaxes of x, kernel and output grad of the same network in float32."""
  def forward(kernels, x):
    acts, h = [], x
    for k in kernels:
      acts.append(h)
      h = jnp.tanh(h @ k)
    return acts, h

  acts, _ = forward(kernels, x)
  def loss_from(i, y):
    h = jnp.tanh(y)
    for k in kernels[i + 1:]:
      h = jnp.tanh(h @ k)
    return jnp.sum(h)
  grads = [jax.grad(lambda y: loss_from(i, y))(acts[i] @ kernels[i]) for i in range(len(kernels))]
  return ([float(jnp.max(jnp.abs(a))) for a in acts],
          [float(jnp.max(jnp.abs(k))) for k in kernels],
          [float(jnp.max(jnp.abs(g))) for g in grads])


def test_scan_over_layers_sharing_one_meta_records_max_over_layers():
  kernels, x = _layer_stack(1)
  meta = fp8jax.init_dot_meta(fp8jax.CurrentScaling())  # current scaling: amaxes don't depend on history

  def loss_fn(kernels, meta, x):
    def layer(carry, kernel):
      h, meta = carry
      y, meta = fp8jax.fp8_dense(h, kernel, None, meta)
      return (jnp.tanh(y), meta), None
    (h, meta), _ = jax.lax.scan(layer, (x, meta), kernels)
    return jnp.sum(h), meta

  _, _, new_meta = jax.jit(fp8jax.value_and_grad(loss_fn))(kernels, meta, x)
  ax, ak, ag = _reference_amaxes(kernels, x)
  got = _newest(new_meta)
  # FP8 forward changes later activations slightly, so compare x/grad with a tolerance
  # of a few E4M3/E5M2 ulps; kernels enter unquantized, so their amax is exact.
  assert got["kernel"] == np.float32(max(ak))
  np.testing.assert_allclose(got["x"], max(ax), rtol=0.15)
  np.testing.assert_allclose(got["grad"], max(ag), rtol=0.25)
  # Not the sum and not the last layer (the max sits in layer 1 for kernels).
  assert got["kernel"] < 0.9 * sum(ak) and got["kernel"] > 1.5 * ak[-1]
  assert got["grad"] < 0.9 * sum(ag) and got["grad"] != pytest.approx(ag[-1], rel=0.25)


def test_scan_over_layers_with_stacked_meta_records_each_layer_separately():
  kernels, x = _layer_stack(2)
  metas = jax.tree.map(lambda a: jnp.stack([a] * 4), fp8jax.init_dot_meta(fp8jax.CurrentScaling()))

  def loss_fn(kernels, metas, x):
    def layer(h, inputs):
      kernel, meta = inputs
      y, meta = fp8jax.fp8_dense(h, kernel, None, meta)
      return jnp.tanh(y), meta
    h, metas = jax.lax.scan(layer, x, (kernels, metas))
    return jnp.sum(h), metas

  _, _, new_metas = jax.jit(fp8jax.value_and_grad(loss_fn))(kernels, metas, x)
  ax, ak, ag = _reference_amaxes(kernels, x)
  np.testing.assert_array_equal(np.asarray(new_metas.kernel.amax_history[:, 0]), np.float32(ak))
  np.testing.assert_allclose(np.asarray(new_metas.x.amax_history[:, 0]), ax, rtol=0.15)
  np.testing.assert_allclose(np.asarray(new_metas.grad.amax_history[:, 0]), ag, rtol=0.25)


def test_microbatch_accumulation_records_max_over_microbatches_once():
  kk, kx = jax.random.split(jax.random.key(3))
  kernel = jax.random.normal(kk, (16, 4))
  # Microbatch 1 has the largest inputs and (via the target) the largest grads.
  gains = jnp.array([1.0, 5.0, 2.0, 0.5])[:, None, None]
  xs = jax.random.normal(kx, (4, 8, 16)) * gains
  targets = jnp.ones((4, 8, 4)) * gains
  meta = fp8jax.init_dot_meta(RECIPE)

  def loss_fn(kernel, meta, batch):
    x, t = batch
    y, meta = fp8jax.fp8_dense(x, kernel, None, meta)
    return jnp.sum(y * t), meta

  loss, grads, new_meta = jax.jit(
      lambda k, m, b: fp8jax.accumulate_gradients(loss_fn, k, m, b))(kernel, meta, (xs, targets))
  got = _newest(new_meta)
  assert got["x"] == float(jnp.max(jnp.abs(xs)))
  assert got["x"] == float(jnp.max(jnp.abs(xs[1])))
  assert got["grad"] == 5.0 and got["kernel"] == float(jnp.max(jnp.abs(kernel)))
  # One entry per step, whatever the number of microbatches.
  np.testing.assert_array_equal(np.asarray(new_meta.x.amax_history[1:]), 0.0)
  # Gradient is the mean over microbatches of each microbatch's gradient.
  want = sum(jax.grad(lambda k: loss_fn(k, meta, (xs[i], targets[i]))[0])(kernel)
             for i in range(4)) / 4
  np.testing.assert_allclose(np.asarray(grads), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert np.isfinite(float(loss))


def test_tied_kernel_used_twice_records_max_of_both_uses():
  kk, ka, kb = jax.random.split(jax.random.key(4), 3)
  kernel = jax.random.normal(kk, (8, 8))
  a, b = jax.random.normal(ka, (4, 8)), 7 * jax.random.normal(kb, (4, 8))
  meta = fp8jax.init_dot_meta(RECIPE)

  def loss_fn(kernel, meta, a, b):
    ya, meta = fp8jax.fp8_dense(a, kernel, None, meta)
    yb, meta = fp8jax.fp8_dense(b, kernel, None, meta)
    return jnp.sum(ya * 2.0) + jnp.sum(yb * 0.5), meta

  _, _, new_meta = jax.jit(fp8jax.value_and_grad(loss_fn))(kernel, meta, a, b)
  got = _newest(new_meta)
  assert got["x"] == float(jnp.max(jnp.abs(b)))  # the larger input, not a + b
  assert got["grad"] == 2.0                       # max(2.0, 0.5), not 2.5 and not the last 0.5


def _train_mlp(optimizer, steps=3):
  kx, k1, k2 = jax.random.split(jax.random.key(5), 3)
  params = {"w1": jax.random.normal(k1, (8, 16)) / 3, "w2": jax.random.normal(k2, (16, 1)) / 4}
  fp8_state = {"l1": fp8jax.init_dot_meta(RECIPE), "l2": fp8jax.init_dot_meta(RECIPE)}
  x = jax.random.normal(kx, (32, 8))
  y = jnp.sum(x, axis=1, keepdims=True)

  def loss_fn(params, state, x, y):
    h, m1 = fp8jax.fp8_dense(x, params["w1"], None, state["l1"])
    out, m2 = fp8jax.fp8_dense(jax.nn.relu(h), params["w2"], None, state["l2"])
    return jnp.mean((out - y) ** 2), {"l1": m1, "l2": m2}

  @jax.jit
  def train_step(params, opt_state, fp8_state, x, y):
    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, x, y)
    assert jax.tree.structure(grads) == jax.tree.structure(params)  # no FP8 leaves in grads
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, fp8_state

  opt_state = optimizer.init(params)
  for _ in range(steps):
    params, opt_state, fp8_state = train_step(params, opt_state, fp8_state, x, y)
  return fp8_state, x


def test_optimizer_never_touches_fp8_state():
  runs = {name: _train_mlp(opt) for name, opt in {
      "sgd": optax.sgd(0.1), "adam": optax.adam(0.05),
      "adamw": optax.adamw(0.05, weight_decay=0.5)}.items()}
  reference, x = runs["sgd"]
  for name, (state, _) in runs.items():
    # Layer 1's input never depends on the parameters: its role's state is
    # bit-identical across optimizers (3 steps, each recording max|x|).
    for a, b in zip(jax.tree.leaves(state["l1"].x), jax.tree.leaves(reference["l1"].x)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(state["l1"].x.amax_history[:3]),
                                  float(jnp.max(jnp.abs(x))))
    # Every scale is the recipe's rule applied to its own history (window max),
    # so nothing (weight decay, Adam moments) moved a scale.
    for meta in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, fp8jax.Fp8Meta)):
      want = np.float32(meta.fmt.max) / np.float32(np.max(np.asarray(meta.amax_history)))
      assert float(meta.scale) == want, name
  # The parameter-dependent roles did see different tensors per optimizer.
  assert float(runs["adamw"][0]["l2"].x.amax_history[0]) != float(reference["l2"].x.amax_history[0])


def test_scale_used_in_step_two_comes_from_step_one_history():
  kernel = jax.random.normal(jax.random.key(6), (16, 16))
  meta = fp8jax.init_dot_meta(RECIPE)

  def loss_fn(kernel, meta, x):
    scale_in_use = meta.x.scale
    y, meta = fp8jax.fp8_dense(x, kernel, None, meta)
    return (jnp.sum(y), scale_in_use), meta

  step = jax.jit(fp8jax.value_and_grad(loss_fn, has_aux=True))
  x1 = 2 * jax.random.normal(jax.random.key(7), (4, 16))
  (_, used1), _, meta1 = step(kernel, meta, x1)
  (_, used2), _, meta2 = step(kernel, meta1, x1 / 8)
  assert float(used1) == 1.0                                              # fresh state
  assert float(used2) == np.float32(448.0) / float(jnp.max(jnp.abs(x1)))  # from step 1's amax
  # Step 2's smaller amax does not lower the window max ("max" over 4 steps).
  assert float(meta2.x.scale) == float(used2)
