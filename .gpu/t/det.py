# f+b with dropout 0.1 (and without): atomics dQ (deterministic=False) vs the separate-dQ structure.
import time, jax, jax.numpy as jnp, numpy as np
import jax_flash
def timeit(f, *a, n=20):
    for _ in range(3): jax.block_until_ready(f(*a))
    ts = []
    for _ in range(n):
        t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))
key = jax.random.key(0)
print("D S causal | rate | fast ms | det ms | det/fast")
for D in (64, 128):
    for S in (1024, 4096, 8192):
        B, H = 16384 // S, 2048 // D
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16) for _ in range(3))
        for causal in (False, True):
            for rate in (0.0, 0.1):
                r = {}
                for det in (False, True):
                    loss = lambda q, k, v: jnp.sum(jax_flash.flash_attention(
                        q, k, v, is_causal=causal, dropout_rate=rate, dropout_rng=key if rate else None,
                        deterministic=det).astype(jnp.float32))
                    r[det] = timeit(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v)
                print(f"{D} {S} {causal} | {rate} | {r[False]:.3f} | {r[True]:.3f} | {r[True]/r[False]:.3f}", flush=True)
