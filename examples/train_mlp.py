"""Train a small Flax MLP regression in bf16 and in FP8 and compare the losses.

The FP8 model swaps `nn.Dense` for `fp8jax.flax.linen.Fp8Dense`; its train step
takes and returns `(params, opt_state, fp8_state)`, all explicit pytrees.

    python examples/train_mlp.py                 # embedded default: 400 steps, width 256
    python examples/train_mlp.py --steps 100 --out out/mlp

Writes `<out>/train_mlp.json` (loss curves, final losses, FP8 scales) and,
when matplotlib is installed, `<out>/train_mlp.png`.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from tqdm import tqdm

import fp8jax
from fp8jax.flax import linen as fp8nn


class MLP(nn.Module):
  """Three dense layers; `dense` builds each layer (bf16 nn.Dense or Fp8Dense)."""

  width: int
  dense: type = nn.Dense

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(self.dense(self.width)(x))
    x = nn.gelu(self.dense(self.width)(x))
    return self.dense(1)(x)


def make_data(key, n, dim):
  """A smooth teacher function of `dim` inputs, with targets of unit scale."""
  k_w, k_x = jax.random.split(key)
  w = jax.random.normal(k_w, (dim, 4)) / jnp.sqrt(dim)
  x = jax.random.normal(k_x, (n, dim))
  y = jnp.sum(jnp.sin(2 * x @ w), axis=1, keepdims=True)
  return x.astype(jnp.bfloat16), y


def train(model, x, y, steps, batch, lr, key, label):
  variables = model.init(key, x[:batch])
  params = variables["params"]
  fp8_state = variables.get("fp8_meta", {})
  tx = optax.adam(optax.cosine_decay_schedule(lr, steps))
  opt_state = tx.init(params)

  def loss_fn(params, fp8_state, xb, yb):
    out, updates = model.apply({"params": params, "fp8_meta": fp8_state}, xb,
                               mutable=["fp8_meta"])
    loss = jnp.mean((out.astype(jnp.float32) - yb) ** 2)
    return loss, updates.get("fp8_meta", {})

  # Donated: the new params, optimizer and FP8 state reuse the old ones' memory.
  @jax.jit(donate_argnums=(0, 1, 2))
  def train_step(params, opt_state, fp8_state, xb, yb):
    loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, fp8_state, loss

  n_batches = x.shape[0] // batch
  if fp8_state:  # once, before the first step: seed the FP8 scales from the first batch
    fp8_state = jax.jit(fp8jax.calibrate(loss_fn))(params, fp8_state, x[:batch], y[:batch])
  losses = []
  start = time.perf_counter()
  for step in tqdm(range(steps), desc=label, leave=False):
    i = step % n_batches
    xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
    params, opt_state, fp8_state, loss = train_step(params, opt_state, fp8_state, xb, yb)
    losses.append(float(loss))
  return losses, fp8_state, time.perf_counter() - start


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--out", default="out")
  args = parser.parse_args(argv)

  x, y = make_data(jax.random.key(0), 16 * args.batch, 32)
  runs = {
      "bf16": MLP(args.width, dense=lambda f: nn.Dense(f, dtype=jnp.bfloat16)),
      "fp8 delayed": MLP(args.width, dense=lambda f: fp8nn.Fp8Dense(
          f, recipe=fp8jax.DelayedScaling(amax_history_len=16))),
      "fp8 current": MLP(args.width, dense=lambda f: fp8nn.Fp8Dense(
          f, recipe=fp8jax.CurrentScaling())),
  }
  results = {}
  for label, model in runs.items():
    losses, fp8_state, seconds = train(model, x, y, args.steps, args.batch, args.lr,
                                       jax.random.key(1), label)
    scales = {"/".join(str(getattr(k, "key", k)) for k in path): float(leaf)
              for path, leaf in jax.tree_util.tree_leaves_with_path(fp8_state)
              if getattr(path[-1], "name", None) == "scale"}
    results[label] = {"losses": losses, "final_loss": sum(losses[-20:]) / 20,
                      "seconds": seconds, "fp8_scales": scales}
    print(f"{label:12s} loss at steps 1/{args.steps // 2}/{args.steps}: "
          f"{losses[0]:.4f} / {losses[args.steps // 2 - 1]:.4f} / {losses[-1]:.4f}"
          f"   (mean of last 20: {results[label]['final_loss']:.4f}, {seconds:.1f}s)")

  base = results["bf16"]["final_loss"]
  for label in ("fp8 delayed", "fp8 current"):
    print(f"{label} / bf16 final loss ratio: {results[label]['final_loss'] / base:.3f}")

  os.makedirs(args.out, exist_ok=True)
  json_path = os.path.join(args.out, "train_mlp.json")
  with open(json_path, "w") as f:
    json.dump({"config": vars(args), "devices": [str(d) for d in jax.devices()],
               "jax_version": jax.__version__, "runs": results}, f, indent=1)
  print(f"wrote {json_path}")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: skipped the loss plot (pip install matplotlib)")
    return results
  fig, ax = plt.subplots(figsize=(7, 4))
  for label, run in results.items():
    ax.plot(run["losses"], label=label, linewidth=1)
  ax.set(xlabel="step", ylabel="MSE loss", yscale="log", title="MLP regression: bf16 vs FP8")
  ax.legend()
  fig.tight_layout()
  png_path = os.path.join(args.out, "train_mlp.png")
  fig.savefig(png_path, dpi=120)
  print(f"wrote {png_path}")
  return results


if __name__ == "__main__":
  main()
