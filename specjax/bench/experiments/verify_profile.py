"""The verify window's cost per matmul and per forward, beside the memory and compute floors.

    .venv/bin/python -m specjax.bench.experiments.verify_profile   # SmolLM2-135M and Qwen2.5-Coder-1.5B
    .venv/bin/python -m specjax.bench.experiments.verify_profile --models smollm2-135m --windows 1,5,9 --repeats 31
    .venv/bin/python -m specjax.bench.experiments.verify_profile --models qwen2.5-coder-1.5b --no-forward  # per matmul only

Weights are constant/random of each preset's shape (timing does not depend on values; nothing is
downloaded). The same report: `specjax bench --verify-profile --model NAME`. What it measures and how:
`specjax.bench.verify_profile`.
"""

import argparse

from specjax.bench import verify_profile


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    p.add_argument("--windows", default=",".join(map(str, verify_profile.WINDOWS)),
                   help="rows per product / tokens per forward (1 is always included)")
    p.add_argument("--repeats", type=int, default=15, help="interleaved repetitions (medians reported)")
    p.add_argument("--matmuls", default=None, help="only these, e.g. q,down,lm_head")
    p.add_argument("--no-forward", action="store_true", help="per matmul only (e.g. 1.5B on a small machine)")
    p.add_argument("--no-matmuls", action="store_true", help="whole forward only")
    p.add_argument("--forms", default=",".join(verify_profile.FORMS),
                   help="per-matmul formulations: kn, nk-xla, nk, nk-kernel (the kernel at every M); the "
                        "forward runs kn and nk, and nk-xla when listed")
    p.add_argument("--baseline-kernel", default=None, metavar="REV",
                   help="also time the kernel of this git revision (nk@REV), interleaved with the current one")
    p.add_argument("--json", default=None, help="write the records here")
    a = p.parse_args()
    verify_profile.main([m.strip() for m in a.models.split(",") if m.strip()],
                        windows=tuple(int(w) for w in a.windows.split(",")), repeats=a.repeats,
                        forward=not a.no_forward, matmuls=not a.no_matmuls,
                        names=a.matmuls.split(",") if a.matmuls else None, json_path=a.json,
                        forms=tuple(a.forms.split(",")), baseline=a.baseline_kernel)


if __name__ == "__main__":
    main()
