"""Train a small GPT with jax_flash attention: ``python -m jax_flash.examples.gpt``.

A decoder-only Transformer in Flax (linen) trained with optax on byte-level
tokens of a small text that ships with the package
(``jax_flash/examples/data/corpus.txt``). The only jax_flash-specific line is
the ``attention_fn`` of ``flax.linen.MultiHeadDotProductAttention``:

* ``--attention jax_flash``: ``jax_flash.flax.make_attention_fn(is_causal=True)``
  and no mask tensor, so the kernel skips the blocks above the diagonal;
* ``--attention flax``: Flax's default attention with
  ``flax.linen.make_causal_mask``, which forms the full score matrix;
* ``--attention cudnn``: ``jax.nn.dot_product_attention(implementation=
  "cudnn")`` with ``is_causal=True`` and no mask (``cudnn_attention_fn``):
  an NVIDIA GPU and bfloat16 or float16 only, and no dropout (jax.nn's cuDNN
  path has none, and Flax's dropout on the attention weights needs the
  weights, which cuDNN never forms), so ``--dropout`` above 0 is refused.

Defaults are tiny so that it finishes in seconds on a CPU. ``--preset
gpt3-small`` is GPT-3 Small's shape (12 layers, d_model 768, 12 heads,
context 2048; bfloat16 compute) for a GPU. ``--compare`` trains with each
attention that can run here, each in a fresh process (peak memory is per
process), says which it skipped and why, and prints step time, tokens/s and
peak memory side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

try:
  import flax.linen as nn
  import optax
except ImportError as e:  # Fail with the fix, not a bare ImportError.
  raise SystemExit(f"jax_flash.examples.gpt needs Flax and optax ({e}); "
                   "install them with `pip install flax optax` (or, in the jax_flash "
                   "checkout, `pip install \".[examples]\"`)") from None

import jax_flash.flax

ATTENTIONS = ("jax_flash", "flax", "cudnn")
CORPUS = pathlib.Path(__file__).parent / "data" / "corpus.txt"
VOCAB = 256  # byte-level tokens: no tokenizer to ship
MiB = 1 << 20

PRESETS = {
    # Seconds on a CPU; the loss falls within a few dozen steps.
    "tiny": dict(layers=2, d_model=64, heads=4, seq_len=64, batch=8, steps=40,
                 learning_rate=3e-3, dtype="float32"),
    # GPT-3 Small (Brown et al. 2020, table 2.1): 125M parameters, lr 6e-4. The
    # batch is far below the paper's 0.5M tokens: this measures speed, not quality.
    "gpt3-small": dict(layers=12, d_model=768, heads=12, seq_len=2048, batch=8, steps=30,
                       learning_rate=6e-4, dtype="bfloat16"),
}


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int
  d_model: int
  heads: int
  seq_len: int
  batch: int
  steps: int
  learning_rate: float
  dtype: str  # compute dtype; parameters and the loss stay float32
  attention: str = "jax_flash"
  dropout: float = 0.0
  seed: int = 0


# -- the model -----------------------------------------------------------------


CUDNN_NO_DROPOUT = (
    "jax.nn.dot_product_attention(implementation='cudnn') has no dropout, and Flax's dropout on "
    "the attention weights needs the weights, which cuDNN never forms")


def cudnn_attention_fn(query, key, value, mask=None, dropout_rate: float = 0.0,
                       deterministic: bool = True):
  """A Flax attention_fn: causal cuDNN attention through jax.nn, with no mask tensor.

  Flax passes only the keyword arguments in this signature; dropout_rate and
  deterministic are in it so that dropout is refused, not silently dropped.
  """
  if dropout_rate > 0.0 and not deterministic:
    raise ValueError(f"cudnn attention: {CUDNN_NO_DROPOUT} (dropout_rate={dropout_rate})")
  return jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=True,
                                      implementation="cudnn")


class Block(nn.Module):
  """Pre-LayerNorm Transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""
  config: Config

  @nn.compact
  def __call__(self, x, mask, deterministic: bool):
    c = self.config
    if c.attention == "jax_flash":
      attention_fn = jax_flash.flax.make_attention_fn(is_causal=True)
    elif c.attention == "cudnn":
      attention_fn = cudnn_attention_fn
    else:
      attention_fn = nn.dot_product_attention  # Flax's default
    h = nn.LayerNorm(dtype=c.dtype)(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=c.heads, dtype=c.dtype, dropout_rate=c.dropout,
        kernel_init=nn.initializers.normal(0.02), attention_fn=attention_fn)(
            h, mask=mask, deterministic=deterministic)
    x = x + h
    h = nn.LayerNorm(dtype=c.dtype)(x)
    h = nn.Dense(4 * c.d_model, dtype=c.dtype, kernel_init=nn.initializers.normal(0.02))(h)
    h = nn.gelu(h)
    h = nn.Dense(c.d_model, dtype=c.dtype, kernel_init=nn.initializers.normal(0.02))(h)
    return x + h


class GPT(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, tokens, deterministic: bool = True):
    c = self.config
    embed = nn.Embed(VOCAB, c.d_model, embedding_init=nn.initializers.normal(0.02),
                     dtype=c.dtype)
    positions = self.param("positions", nn.initializers.normal(0.01), (c.seq_len, c.d_model))
    x = embed(tokens) + positions[:tokens.shape[-1]].astype(c.dtype)
    # jax_flash and cudnn are told "causal" by their attention_fn; Flax's
    # default needs the (B, 1, T, T) mask tensor.
    mask = nn.make_causal_mask(tokens) if c.attention == "flax" else None
    for _ in range(c.layers):
      x = Block(c)(x, mask, deterministic)
    x = nn.LayerNorm(dtype=c.dtype)(x)
    return embed.attend(x).astype(jnp.float32)  # tied output embedding, float32 logits


# -- data ----------------------------------------------------------------------


def load_tokens(min_length: int) -> np.ndarray:
  """The corpus as bytes, repeated when a context is longer than the text."""
  data = np.frombuffer(CORPUS.read_bytes(), np.uint8)
  repeats = math.ceil(min_length / len(data))
  return np.tile(data, repeats) if repeats > 1 else data


def batches(tokens: np.ndarray, config: Config):
  """Random windows of seq_len + 1 bytes: inputs and next-byte targets."""
  rng = np.random.default_rng(config.seed)
  n = config.seq_len + 1
  while True:
    starts = rng.integers(0, len(tokens) - n + 1, config.batch)
    window = np.stack([tokens[s:s + n] for s in starts]).astype(np.int32)
    yield window[:, :-1], window[:, 1:]


# -- training ------------------------------------------------------------------


def make_optimizer(config: Config):
  """AdamW with gradient clipping and a warmup-cosine schedule (GPT-3's recipe, scaled down)."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, warmup_steps=max(1, config.steps // 10),
      decay_steps=max(2, config.steps), end_value=config.learning_rate / 10)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))


def make_train_step(model: GPT, optimizer):
  def loss_fn(params, inputs, targets, rng):
    logits = model.apply(params, inputs, deterministic=model.config.dropout == 0.0,
                         rngs=dict(dropout=rng))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, inputs, targets, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def _peak_memory(compiled) -> dict:
  """Peak memory: the device's allocator peak on GPUs, peak RSS on the CPU,
  plus XLA's static plan for one step (arguments + outputs + temporaries)."""
  result = {}
  try:
    m = compiled.memory_analysis()
    result["static_bytes"] = int(m.argument_size_in_bytes + m.output_size_in_bytes +
                                 m.temp_size_in_bytes - m.alias_size_in_bytes)
    result["temp_bytes"] = int(m.temp_size_in_bytes)
  except Exception:  # Not every backend implements it.
    pass
  device = jax.devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and "peak_bytes_in_use" in stats:
    result["peak_bytes"] = int(stats["peak_bytes_in_use"])
    result["peak_source"] = "device peak_bytes_in_use"
  else:  # Linux reports ru_maxrss in KiB; the whole process, JAX itself included.
    result["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["peak_source"] = "process peak RSS"
  return result


def train(config: Config, log_every: int = 10, out=print) -> dict:
  """Trains config.steps steps; returns losses, timings and memory."""
  model = GPT(config)
  tokens = load_tokens(config.seq_len + 1)
  data = batches(tokens, config)
  inputs, targets = next(data)
  rng = jax.random.key(config.seed)
  params = model.init(rng, inputs)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  optimizer = make_optimizer(config)
  opt_state = optimizer.init(params)

  out(f"GPT: {config.layers} layers, d_model {config.d_model}, {config.heads} heads, "
      f"context {config.seq_len}, batch {config.batch}, {n_params / 1e6:.2f}M parameters, "
      f"{config.dtype}, attention={config.attention}, device={jax.devices()[0].device_kind}")
  t0 = time.perf_counter()
  train_step = make_train_step(model, optimizer).lower(
      params, opt_state, inputs, targets, rng).compile()
  compile_s = time.perf_counter() - t0

  losses, step_times = [], []
  for step in range(config.steps):
    rng, step_rng = jax.random.split(rng)
    t0 = time.perf_counter()
    params, opt_state, loss = train_step(params, opt_state, inputs, targets, step_rng)
    loss = float(loss)  # waits for the step
    step_times.append(time.perf_counter() - t0)
    losses.append(loss)
    if not math.isfinite(loss):
      raise FloatingPointError(f"loss is {loss} at step {step}")
    if step % log_every == 0 or step == config.steps - 1:
      out(f"  step {step:4d}  loss {loss:.4f}  {1e3 * step_times[-1]:8.1f} ms")
    inputs, targets = next(data)

  # The first step includes one-time work (transfers, allocator warm-up).
  timed = step_times[1:] or step_times
  step_s = statistics.median(timed)
  result = dict(config=dataclasses.asdict(config), parameters=int(n_params), losses=losses,
                compile_s=compile_s, step_s=step_s,
                tokens_per_s=config.batch * config.seq_len / step_s,
                **_peak_memory(train_step))
  out(f"{config.attention}: {1e3 * step_s:.1f} ms/step (median), "
      f"{result['tokens_per_s']:,.0f} tokens/s, peak {result['peak_bytes'] / MiB:,.0f} MiB "
      f"({result['peak_source']}), XLA static {result.get('static_bytes', 0) / MiB:,.0f} MiB, "
      f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  return result


# -- comparison ------------------------------------------------------------------


def why_not(config: Config) -> list[str]:
  """Why config's attention cannot run here ([] if it can); checked before anything is built."""
  if config.attention != "cudnn":
    return []
  reasons = []
  if jax.default_backend() != "gpu":
    reasons.append("jax.nn.dot_product_attention(implementation='cudnn') needs an NVIDIA GPU "
                   f"(jax's default backend here is {jax.default_backend()})")
  if config.dtype not in ("bfloat16", "float16"):
    reasons.append(f"cuDNN attention takes bfloat16 or float16, not {config.dtype} "
                   "(--dtype bfloat16)")
  if config.dropout > 0.0:
    reasons.append(f"{CUDNN_NO_DROPOUT}: use --dropout 0, or --attention jax_flash (dropout "
                   "inside the kernel) or flax")
  return reasons


def _run_child(argv: list[str], attention: str) -> dict:
  """One training run of `attention` in a fresh process: its result, or why it did not run."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "result.json")
    cmd = [sys.executable, "-m", "jax_flash.examples.gpt", *argv,
           "--attention", attention, "--result-json", path]
    proc = subprocess.run(cmd)
    result = json.load(open(path)) if os.path.exists(path) else None
  if result is None or (proc.returncode != 0 and "skipped" not in result):
    print(f"{attention}: failed (exit {proc.returncode})", flush=True)
    result = dict(config=dict(attention=attention), failed=True)
  return result


def compare(argv: list[str], attentions=ATTENTIONS, rounds: int = 1) -> list[dict]:
  """Runs each attention in a fresh process (peaks are per process) and prints a table;
  an attention that cannot run here is skipped, with the reason. With rounds > 1 the
  attentions run that many times, the order rotated each round (so that no attention
  always runs first), and each one's step time is the median of its rounds' (the spread:
  their lowest and highest): one 10-step run of GPT-3 Small moves by a few ms."""
  runs = {attention: [] for attention in attentions}
  for r in range(rounds):
    for attention in attentions[r % len(attentions):] + attentions[:r % len(attentions)]:
      if runs[attention] and ("skipped" in runs[attention][0] or runs[attention][0].get("failed")):
        continue  # the same reason every round
      runs[attention].append(_run_child(argv, attention))
  results = []
  for attention in attentions:
    result = runs[attention][0]
    if rounds > 1 and not result.get("failed") and "skipped" not in result:
      done = [x for x in runs[attention] if not x.get("failed")]
      steps = sorted(x["step_s"] for x in done)
      result = dict(result, step_s=statistics.median(steps), round_step_s=steps,
                    tokens_per_s=statistics.median(x["tokens_per_s"] for x in done))
    results.append(result)
  ok = [r for r in results if not r.get("failed") and "skipped" not in r]
  base = next((r for r in ok if r["config"]["attention"] == "flax"), None)
  spread = rounds > 1
  print("\nattention    ms/step" + ("      spread" if spread else "") +
        "   tokens/s   peak MiB   XLA static MiB   vs flax")
  for r in ok:
    ratios = ""
    if base:
      ratios = (f"speed {base['step_s'] / r['step_s']:.2f}x, "
                f"peak memory {r['peak_bytes'] / base['peak_bytes']:.2f}x")
    low_high = ""
    if spread:
      steps = r["round_step_s"]
      low_high = f" {1e3 * steps[0]:5.1f}-{1e3 * steps[-1]:<5.1f}"
    print(f"{r['config']['attention']:<11} {1e3 * r['step_s']:8.1f}{low_high} "
          f"{r['tokens_per_s']:10,.0f} "
          f"{r['peak_bytes'] / MiB:10,.0f} {r.get('static_bytes', 0) / MiB:16,.0f}   {ratios}")
  for r in results:
    if "skipped" in r:
      print(f"{r['config']['attention']:<11} skipped: {r['skipped']}")
  return results


def parse_args(argv):
  # No abbreviations: --compare re-runs this command line without "--compare"
  # in child processes, and an abbreviation of it would survive the removal.
  p = argparse.ArgumentParser(prog="python -m jax_flash.examples.gpt",
                              description=__doc__.split("\n")[0], allow_abbrev=False)
  p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                 help="base configuration; the flags below override it (default: tiny)")
  for name, kind in (("layers", int), ("d-model", int), ("heads", int), ("seq-len", int),
                     ("batch", int), ("steps", int), ("learning-rate", float)):
    p.add_argument(f"--{name}", type=kind)
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
  p.add_argument("--dropout", type=float, default=0.0,
                 help="attention dropout rate (not with --attention cudnn: jax.nn's cuDNN "
                      "attention has no dropout)")
  p.add_argument("--attention", choices=ATTENTIONS, default="jax_flash",
                 help="jax_flash (make_attention_fn(is_causal=True)), flax (Flax's default with "
                      "make_causal_mask) or cudnn (jax.nn.dot_product_attention(implementation="
                      "'cudnn'), is_causal; NVIDIA GPU, bfloat16/float16)")
  p.add_argument("--compare", action="store_true",
                 help="train with each attention that can run here, one process each")
  p.add_argument("--rounds", type=int, default=1,
                 help="with --compare: run the attentions this many times, in rotated order, "
                      "and report each one's median step time and spread (default 1)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--result-json", help=argparse.SUPPRESS)  # used by --compare
  return p.parse_args(argv)


def config_from_args(args) -> Config:
  values = dict(PRESETS[args.preset])
  for field in ("layers", "d_model", "heads", "seq_len", "batch", "steps", "learning_rate",
                "dtype"):
    if getattr(args, field) is not None:
      values[field] = getattr(args, field)
  if values["d_model"] % values["heads"]:
    raise SystemExit(f"--d-model ({values['d_model']}) must be a multiple of --heads "
                     f"({values['heads']})")
  return Config(**values, attention=args.attention, dropout=args.dropout, seed=args.seed)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.rounds != 1 and not args.compare:
    raise SystemExit(f"--rounds {args.rounds} needs --compare (one attention runs once)")
  if args.compare:
    if args.rounds < 1:
      raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    # The children get the same flags, minus --compare, --rounds and --attention.
    child, skip = [], False
    for a in argv:
      if skip:
        skip = False
      elif a == "--compare":
        continue
      elif a in ("--attention", "--rounds"):
        skip = True
      elif not a.startswith(("--attention=", "--rounds=")):
        child.append(a)
    return compare(child, rounds=args.rounds)
  config = config_from_args(args)
  if reasons := why_not(config):  # At once, before the model is built.
    if args.result_json:  # for --compare: skipped, with the reason
      with open(args.result_json, "w") as f:
        json.dump(dict(config=dataclasses.asdict(config), skipped="; ".join(reasons)), f)
    raise SystemExit(f"--attention {config.attention} cannot run here: " + "; ".join(reasons))
  result = train(config, log_every=args.log_every, out=functools.partial(print, flush=True))
  if args.result_json:
    with open(args.result_json, "w") as f:
      json.dump(result, f)
  return result


if __name__ == "__main__":
  main()
