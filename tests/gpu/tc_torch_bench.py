"""Speed of torch's scaled_dot_product_attention (flash and cuDNN backends)
at the shapes tc_kernel_check bench uses (B * S = 16k tokens, H * D = 2048),
for a same-machine comparison.

  python3 tests/gpu/tc_torch_bench.py                      # bench's shapes, fwd and bwd
  python3 tests/gpu/tc_torch_bench.py --fwd --seqs 1024,2048,4096,8192,16384   # bench_fwd's
  python3 tests/gpu/tc_torch_bench.py --dropout 0.1   # what dropout costs each backend

With --dropout P every backend runs with and without dropout_p=P and the row
gives both TFLOP/s (counted as the plain problem's) and the time ratio
(issue 11's dropout target: at most 1.15x).
"""
import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F


def bench(fn, iters=20):
  for _ in range(3):
    fn()
  a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  ts = []
  for _ in range(iters):
    a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
  ts.sort()
  return ts[len(ts) // 2]


parser = argparse.ArgumentParser()
parser.add_argument("--fwd", action="store_true", help="forward only")
parser.add_argument("--seqs", default="4096,16384", help="sequence lengths, comma-separated")
parser.add_argument("--dims", default="64,128", help="head dims, comma-separated (bench_d: 96,192,256)")
parser.add_argument("--dropout", type=float, default=0.0, help="also time dropout_p=P")
opts = parser.parse_args()

for d in (int(x) for x in opts.dims.split(",")):
  for causal in (False, True):
    for s in (int(x) for x in opts.seqs.split(",")):
      bsz, h = 16384 // s, 2048 // d
      q, k, v = (torch.randn(bsz, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                 for _ in range(3))
      flops = 4 * bsz * h * s * s * d * (0.5 if causal else 1.0)
      row = []
      for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
          with sdpa_kernel(be):
            times = []
            for p in ((0.0, opts.dropout) if opts.dropout else (0.0,)):
              attend = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
              tf = bench(attend)
              tb = None
              if not opts.fwd:
                out = attend()
                g = torch.randn_like(out)
                tb = bench(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
              times.append((tf, tb))
          for (tf, tb), label in zip(times, ("", f" dropout {opts.dropout}")):
            row.append(f"{name}{label} fwd {flops / tf * 1e-9:.0f}" +
                       ("" if tb is None else f" bwd {2.5 * flops / tb * 1e-9:.0f}"))
          if len(times) == 2:
            (f0, b0), (f1, b1) = times
            row.append(f"{name} dropout x time fwd {f1 / f0:.2f}" +
                       ("" if b0 is None else f" f+b {(f1 + b1) / (f0 + b0):.2f}"))
        except Exception as e:  # a backend may be unavailable
          row.append(f"{name} n/a ({type(e).__name__})")
      print(f"TORCH B{bsz} S{s} H{h} D{d} {'causal' if causal else 'full'}: " + " | ".join(row),
            flush=True)
