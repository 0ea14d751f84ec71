"""Speed of torch's scaled_dot_product_attention (flash and cuDNN backends)
at the shapes tc_kernel_check bench uses, for a same-machine comparison."""
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


for d in (64, 128):
  for s in (4096, 16384):
    for causal in (False, True):
      bsz, h = 16384 // s, 2048 // d
      q, k, v = (torch.randn(bsz, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                 for _ in range(3))
      flops = 4 * bsz * h * s * s * d * (0.5 if causal else 1.0)
      row = []
      for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
          with sdpa_kernel(be):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            g = torch.randn_like(out)
            tf = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            tb = bench(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
          row.append(f"{name} fwd {flops / tf * 1e-9:.0f} bwd {2.5 * flops / tb * 1e-9:.0f}")
        except Exception as e:  # a backend may be unavailable
          row.append(f"{name} n/a ({type(e).__name__})")
      print(f"TORCH B{bsz} S{s} H{h} D{d} {'causal' if causal else 'full'}: " + " | ".join(row), flush=True)
