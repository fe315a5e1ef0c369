"""The kernels a device ran, from a JAX profiler trace.

    result, trace = record(lambda: run_three_steps())     # jax.profiler around the call
    events, source = kernel_events(trace, module="jit_train_step")

`record` writes the trace into a temporary folder and reads back the Chrome trace JSON that
JAX writes beside the XPlane (`plugins/profile/<run>/<host>.trace.json.gz`): a list of
events, "ph": "X" for a span with "ts" (start) and "dur" in microseconds, and "M" events
naming each process ("pid") and thread ("tid"). On a GPU the device is a process named
`/device:GPU:<n>` whose threads are its streams (`Stream #<id>(Compute,...)`); each kernel
and memcpy / memset is one event named after the kernel, with "args" from the XLA runtime's
annotation ("hlo_op": the HLO instruction, "hlo_module"; inside a CUDA graph the graph's
command buffer instead). On a CPU there is no device process: XLA:CPU records each thunk it
runs as a host event with the same "hlo_op" and "hlo_module" args, so `kernel_events` falls
back to those (threads overlap there; a CPU table is a smoke test, not a profile).
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
import tempfile
from typing import Any, Callable

import jax

_GPU_PROCESS = re.compile(r"^/device:GPU:\d+")


@dataclasses.dataclass(frozen=True)
class KernelEvent:
  """One kernel (or memcpy / memset) the device ran.

  Attributes:
    name: the kernel's name.
    hlo_op: the HLO instruction it ran for, as the trace says ('' if it does not).
    start_us, duration_us: when it started and how long it ran, in microseconds.
    stream: the stream (GPU) or thread (CPU) it ran on.
  """

  name: str
  hlo_op: str
  start_us: float
  duration_us: float
  stream: str


def record(run: Callable[[], Any]) -> tuple[Any, dict]:
  """(run(), the trace of it): `run` must wait for its device work (block_until_ready).

  Python calls are not traced (they would outnumber the kernels), nor the HLO of the
  programs run (the caller has it).
  """
  options = jax.profiler.ProfileOptions()
  for name, value in (("python_tracer_level", 0), ("enable_hlo_proto", False)):
    if hasattr(options, name):
      setattr(options, name, value)
  with tempfile.TemporaryDirectory(prefix="fp8jax-trace-") as folder:
    with jax.profiler.trace(folder, profiler_options=options):
      result = run()
    return result, read_trace(folder)


def read_trace(folder: str) -> dict:
  """The Chrome trace JSON that a `jax.profiler.trace(folder)` wrote (the newest one)."""
  found = sorted(glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.trace.json.gz")),
                 key=os.path.getmtime)
  if not found:
    raise FileNotFoundError(f"no plugins/profile/*/*.trace.json.gz under {folder}: this JAX "
                            "wrote no Chrome trace beside its XPlane.")
  with gzip.open(found[-1], "rt") as f:
    return json.load(f)


def kernel_events(trace: dict, module: str | None = None) -> tuple[list[KernelEvent], str]:
  """The device's kernels in `trace`, in start order, and where they came from.

  Args:
    trace: a Chrome trace as `record` returns it.
    module: the HLO module traced (e.g. 'jit_train_step'): events that name another
      module are left out (events that name none, such as memcpys, stay). Ignored when no
      event names it (a runtime that spells module names otherwise).

  Returns:
    (events, source): source is "gpu" (the kernels of the `/device:GPU:*` processes'
    streams), "cpu" (XLA:CPU's per-thunk host events) or "none" (no kernel found).
  """
  events = trace.get("traceEvents", [])
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      processes[e.get("pid")] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
  spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
  gpus = {pid for pid, name in processes.items() if _GPU_PROCESS.match(name)}
  if gpus:
    source = "gpu"
    # A device's streams are its "Stream #..." threads; other threads of the device
    # process (where a converter adds them) repeat the same kernels grouped by op or module.
    streams = {key for key, name in threads.items() if key[0] in gpus and name.startswith("Stream")}
    chosen = [e for e in spans if e.get("pid") in gpus
              and (not streams or (e.get("pid"), e.get("tid")) in streams)]
  else:
    source = "cpu"
    chosen = _innermost([e for e in spans if "hlo_op" in e.get("args", {})])
  modules = {e.get("args", {}).get("hlo_module") for e in chosen}
  if module is not None and module in modules:
    chosen = [e for e in chosen if e.get("args", {}).get("hlo_module", module) == module]
  kernels = [KernelEvent(name=str(e.get("name", "")),
                         hlo_op=str(e.get("args", {}).get("hlo_op", "")),
                         start_us=float(e["ts"]), duration_us=float(e["dur"]),
                         stream=threads.get((e.get("pid"), e.get("tid")), str(e.get("tid"))))
             for e in chosen]
  return sorted(kernels, key=lambda k: k.start_us), (source if kernels else "none")


def _innermost(events: list[dict]) -> list[dict]:
  """`events` less those that enclose another one on their thread: XLA:CPU records a
  `while` or `conditional` as one event around the thunks it runs."""
  by_thread: dict = {}
  for e in events:
    by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
  kept = []
  for thread in by_thread.values():
    thread.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
    for e, after in zip(thread, thread[1:] + [None]):
      end = float(e["ts"]) + float(e["dur"])
      inside = (after is not None and float(after["ts"]) < end
                and float(after["ts"]) + float(after["dur"]) <= end)
      if not inside:
        kept.append(e)
  return kept
