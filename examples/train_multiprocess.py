"""Data-parallel FP8 training of the MLP across several processes (JAX multi-controller).

Each process runs the same program on its own devices; `jax.distributed`
connects them and the FP8 amaxes are reduced across all of them, so every
process ends with the same parameters and the same FP8 state.

    # all processes on this machine (CPU, loopback), then compare their results:
    python examples/train_multiprocess.py --num-processes 2 --out out/mp

    # one worker of a real cluster (run on each host with its own --process-id);
    # JAX picks the platform (GPU where there is one), --cpu forces CPU + gloo:
    python examples/train_multiprocess.py --worker --process-id 0 --num-processes 2 \\
        --coordinator 10.0.0.1:12355 --out out/mp

`--mode shard_map` (default) writes the step as per-device code with
`jax.shard_map`; `--mode jit` lets XLA partition a global-array step (GSPMD).
`--batch` is the global batch; it must divide evenly over all devices.
The launcher passes `--steps`, `--batch`, `--mode` and `--out` on to its workers
and starts them with `--cpu`: one CPU device each, collectives over gloo.
Each worker writes `<out>/process_<i>.npz` (parameters and FP8 state) and
`<out>/process_<i>.json` (losses and, per step, the recorded input amax of the
first layer next to the amaxes of the whole global batch and of the process's own rows).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


# Flags that only the launcher reads, and flags that only a worker reads; every
# other flag is given to both and forwarded by the launcher (`worker_command`).
LAUNCHER_ONLY = ("timeout",)
WORKER_ONLY = ("worker", "process_id", "coordinator", "cpu")


def worker_command(process_id: int, coordinator: str, *, num_processes: int, out: str,
                   steps: int, batch: int, mode: str) -> list[str]:
  """The command line of one loopback worker: on CPU, with the launcher's settings."""
  return [sys.executable, os.path.abspath(__file__), "--worker", "--cpu",
          "--process-id", str(process_id), "--num-processes", str(num_processes),
          "--coordinator", coordinator, "--out", str(out), "--steps", str(steps),
          "--batch", str(batch), "--mode", mode]


def launch(num_processes: int, out: str, steps: int = 8, mode: str = "shard_map",
           timeout_s: float = 240.0, batch: int = 64) -> dict:
  """Starts `num_processes` local CPU workers over loopback and compares their results.

  Every worker is killed if one fails, the time limit passes or the launcher is
  interrupted.

  Returns:
    {"identical": bool, "processes": [per-process JSON], "out": out}.

  Raises:
    RuntimeError: a worker failed or timed out (its output tail is in the message).
  """
  out_dir = pathlib.Path(out)
  out_dir.mkdir(parents=True, exist_ok=True)
  coordinator = f"127.0.0.1:{free_port()}"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one CPU device per process
  workers = []
  deadline = time.monotonic() + timeout_s
  failure = None
  try:
    for pid in range(num_processes):
      log = open(out_dir / f"process_{pid}.log", "w")
      cmd = worker_command(pid, coordinator, num_processes=num_processes, out=str(out_dir),
                           steps=steps, batch=batch, mode=mode)
      workers.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True), log))
    while failure is None and any(p.poll() is None for p, _ in workers):
      if any(p.poll() not in (None, 0) for p, _ in workers):
        failure = "a worker exited with an error"
      elif time.monotonic() > deadline:
        failure = f"timed out after {timeout_s:.0f}s"
      time.sleep(0.2)
    if failure is None and any(p.returncode != 0 for p, _ in workers):
      failure = "a worker exited with an error"
  finally:
    for proc, log in workers:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
      log.close()
  if failure:
    tails = "\n".join(f"--- process {i} (exit {p.returncode}) ---\n" +
                      (out_dir / f"process_{i}.log").read_text()[-3000:]
                      for i, (p, _) in enumerate(workers))
    raise RuntimeError(f"multi-process training failed: {failure}\n{tails}")
  import numpy as np
  arrays = [np.load(out_dir / f"process_{i}.npz") for i in range(num_processes)]
  identical = all(set(a.files) == set(arrays[0].files) and
                  all(np.array_equal(a[k], arrays[0][k]) for k in a.files) for a in arrays[1:])
  processes = [json.loads((out_dir / f"process_{i}.json").read_text())
               for i in range(num_processes)]
  return {"identical": identical, "processes": processes, "out": str(out_dir)}


def worker(args) -> None:
  import jax
  if args.cpu:  # else the platform is JAX's choice: the GPUs of a GPU host
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                             initialization_timeout=60)
  if args.batch % jax.device_count():
    raise ValueError(f"--batch {args.batch} does not split over {jax.device_count()} devices "
                     f"({args.num_processes} processes); pass a multiple of "
                     f"{jax.device_count()}.")
  import flax.linen as nn
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import fp8jax
  from fp8jax.flax import linen as fp8nn
  from train_mlp import MLP, make_data  # this script's directory is on sys.path

  mesh = jax.make_mesh((jax.device_count(),), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  replicated = NamedSharding(mesh, P())
  by_rows = NamedSharding(mesh, P("data"))
  batch = args.batch
  x_all, y_all = make_data(jax.random.key(0), args.steps * batch, 32)  # same on every process
  model = MLP(64, dense=lambda f: fp8nn.Fp8Dense(f, recipe=fp8jax.DelayedScaling(4)))
  variables = model.init(jax.random.key(1), x_all[:batch])
  tx = optax.adam(3e-3)

  def loss_fn(params, fp8_state, xb, yb):
    out, updates = model.apply({"params": params, "fp8_meta": fp8_state}, xb,
                               mutable=["fp8_meta"])
    # Normalized by the global batch: per-device gradients of the loss are the
    # one-device ones, so are the gradient amaxes.
    return jnp.sum((out.astype(jnp.float32) - yb) ** 2) / batch, updates["fp8_meta"]

  if args.mode == "shard_map":
    def per_device(params, fp8_state, xb, yb):
      # fp8jax reduces the amaxes over "data" (max); JAX sums the gradients.
      loss, grads, fp8_state = fp8jax.value_and_grad(loss_fn)(params, fp8_state, xb, yb)
      return jax.lax.psum(loss, "data"), grads, fp8_state
    grads_fn = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                             out_specs=(P(), P(), P()))
  else:
    grads_fn = fp8jax.value_and_grad(loss_fn)  # global arrays: the amax is already global

  @jax.jit
  def train_step(params, opt_state, fp8_state, xb, yb):
    loss, grads, fp8_state = grads_fn(params, fp8_state, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, fp8_state, loss

  def global_array(value, sharding):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  params = jax.tree.map(lambda a: global_array(a, replicated), variables["params"])
  fp8_state = jax.tree.map(lambda a: global_array(a, replicated), variables["fp8_meta"])
  opt_state = jax.tree.map(lambda a: global_array(a, replicated), tx.init(variables["params"]))
  local = lambda a: np.asarray(a.addressable_data(0))
  rows = batch // jax.process_count()
  log = {"process_index": jax.process_index(), "devices": jax.device_count(), "mode": args.mode,
         "platform": jax.devices()[0].platform, "batch": batch, "steps": args.steps,
         "losses": [], "x_amax_recorded": [], "x_amax_global_batch": [], "x_amax_own_rows": []}
  for step in range(args.steps):
    xb, yb = x_all[step * batch:(step + 1) * batch], y_all[step * batch:(step + 1) * batch]
    lo = jax.process_index() * rows  # this process feeds only its own rows
    xs = jax.make_array_from_process_local_data(by_rows, np.asarray(xb[lo:lo + rows]))
    ys = jax.make_array_from_process_local_data(by_rows, np.asarray(yb[lo:lo + rows]))
    params, opt_state, fp8_state, loss = train_step(params, opt_state, fp8_state, xs, ys)
    log["losses"].append(float(local(loss)))
    log["x_amax_recorded"].append(float(local(fp8_state["Fp8Dense_0"]["dot_meta"].x.amax_history)[0]))
    log["x_amax_global_batch"].append(float(jnp.max(jnp.abs(xb.astype(jnp.float32)))))
    log["x_amax_own_rows"].append(float(jnp.max(jnp.abs(xb[lo:lo + rows].astype(jnp.float32)))))

  flat = {jax.tree_util.keystr(path): local(leaf) for tree_name, tree in
          (("params", params), ("fp8_state", fp8_state))
          for path, leaf in jax.tree_util.tree_leaves_with_path({tree_name: tree})}
  out = pathlib.Path(args.out)
  np.savez(out / f"process_{jax.process_index()}.npz", **flat)
  (out / f"process_{jax.process_index()}.json").write_text(json.dumps(log, indent=1))
  jax.distributed.shutdown()


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num-processes", type=int, default=2)
  parser.add_argument("--worker", action="store_true", help="run one worker (else: launch all)")
  parser.add_argument("--process-id", type=int, default=None, help="worker: its index")
  parser.add_argument("--coordinator", default=None, help="worker: host:port of process 0")
  parser.add_argument("--cpu", action="store_true",
                      help="worker: run on CPU with gloo collectives (else JAX picks)")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--batch", type=int, default=64, help="global batch (all processes)")
  parser.add_argument("--mode", choices=["shard_map", "jit"], default="shard_map")
  parser.add_argument("--timeout", type=float, default=None,
                      help="launcher: seconds before all workers are killed (default 240)")
  parser.add_argument("--out", default="out/multiprocess")
  return parser


def main(argv=None):
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.batch < 1 or args.batch % args.num_processes:
    parser.error(f"--batch {args.batch} does not split over --num-processes "
                 f"{args.num_processes}; pass a positive multiple of it.")
  if args.worker:
    if args.coordinator is None or args.process_id is None:
      parser.error("--worker needs --coordinator host:port and --process-id")
    if args.timeout is not None:
      parser.error("--timeout is the launcher's limit; a worker waits for its peers "
                   "(jax.distributed) instead")
    worker(args)
    return None
  if args.coordinator is not None or args.process_id is not None:
    parser.error("--coordinator and --process-id are for --worker; the launcher starts "
                 "all processes on this machine and picks a loopback port itself")
  result = launch(args.num_processes, args.out, args.steps, args.mode,
                  240.0 if args.timeout is None else args.timeout, args.batch)
  losses = result["processes"][0]["losses"]
  print(f"{args.num_processes} processes, {args.steps} steps ({args.mode}): loss "
        f"{losses[0]:.4f} -> {losses[-1]:.4f}; params and FP8 state identical on all "
        f"processes: {result['identical']}")
  if not result["identical"]:
    sys.exit(1)
  return result


if __name__ == "__main__":
  # A terminated launcher still runs launch()'s cleanup, which kills the workers.
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
  main()
