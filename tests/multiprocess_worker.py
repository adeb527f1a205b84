"""One process of `test_sharding.test_two_processes_equal_one_device`: argv = process id, port, out dir."""

import json
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402

pid, port, out = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
jax.config.update("jax_numpy_rank_promotion", "raise")

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_sharding import GREEDY, METHODS, MULTI, PROMPTS, SAMPLED, make_assets  # noqa: E402

from specjax import sharding  # noqa: E402
from specjax.serving.engine import Engine  # noqa: E402
from specjax.methods.draft.record import DraftModel  # noqa: E402
from specjax.methods.medusa.record import LoadedHeads  # noqa: E402

target, draft, heads = make_assets()  # same seeds: the same weights on every process
eng = Engine(target, mesh=sharding.make_mesh(data=4, model=2),
             assets={"draft": DraftModel(draft), "medusa": LoadedHeads(heads)})
record = dict(devices=[jax.device_count(), jax.local_device_count()],
              decided=sharding.broadcast_from_0(f"process {pid}"))
for name, (method, mode) in MULTI.items():
    kw = GREEDY if mode == "greedy" else SAMPLED
    record[name] = [r.tokens for r in eng.generate(PROMPTS, spec=METHODS[method], **kw)]
(out / f"process_{pid}.json").write_text(json.dumps(record))
print(f"process {pid} done", flush=True)
