"""Step-time check on an accelerator with random SmolLM2-shaped weights (no download needed).

Measures the plain loop's tok/s and the cost of 1/5/9-token forwards, fp32 and bf16, and the
prompt-lookup loop's time per target forward. Forward time does not depend on the weights' values.
Usage: python scripts/device_bench.py [DTYPE ...]   (default: float32 bfloat16)
"""

import sys

import jax

from specjax.bench.offline import window_costs
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine
from specjax.models import config, loader

print("devices:", jax.devices())
for dtype in sys.argv[1:] or ("float32", "bfloat16"):
    cfg = config.preset("smollm2-135m", dtype=dtype, param_dtype=dtype)
    model = loader.init_model(cfg)
    w = window_costs(model, cache_len=384, at=200, windows=(1, 5, 9), repeats=50)
    print(dtype, "forward ms 1/5/9:", {k: round(v, 3) for k, v in w.items()},
          "5/1: %.2fx" % (w[5] / w[1]))
    eng = Engine(model)
    prompt = list(range(100, 200))
    for spec in (SpecConfig(), SpecConfig(method="ngram", k=4)):
        for batch in (1, 16):
            for _ in range(2):
                r = eng.generate([prompt] * batch, max_new_tokens=128, stop_ids=(), spec=spec)
            per_fwd = (r[0].wall_s - r[0].ttft_s) / max(1, r[0].target_forwards) * 1e3
            print(f"{dtype} {spec.method} batch {batch}: {r[0].tok_per_s * batch:.0f} tok/s total, "
                  f"ttft {r[0].ttft_s * 1e3:.1f} ms, {per_fwd:.2f} ms/forward, tau {r[0].tau:.2f}, "
                  f"compile {r[0].compile_s:.1f} s", flush=True)
