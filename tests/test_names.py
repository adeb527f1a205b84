"""One dimension alphabet: every jaxtyping shape string and einsum string in the packages uses the
names written at the top of `specjax.models.llama` (STYLE.md, "Names carry shapes")."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("specjax", "models", "train_heads")  # models/ is specjax.models

# The alphabet of type hints (see the docstring of specjax.models.llama for each name's meaning).
DIMS = {"B", "T", "S", "N", "G", "Kv", "H", "D", "F", "V", "L", "K",
        "W", "P", "E", "A", "R", "M", "Vd", "Df", "Z", "Ng", "Kf", "Sr", "Kt", "Q",
        "Cs", "Sa", "Ca", "Kc", "Lb", "Tl"}
# Einsum subscripts are single letters: the single-letter names above, C for Kv, O for the output
# side of a square [D, D] weight; lowercase letters are a plain matmul's m, n, k.
EINSUM = {d for d in DIMS if len(d) == 1} | {"C", "O"} | set("mnk")

HINT = re.compile(r"\b(?:Float|Int|Bool|Key|Shaped|Num|Real|Inexact|Integer|UInt|Complex)\[\s*[\w.]+\s*,\s*\"([^\"]*)\"")
EINSUM_CALL = re.compile(r"einsum\(\s*\"([^\"]*)\"")


def _sources():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def _names(dims: str) -> list[str]:
    """The dimension names of a jaxtyping shape string: modifiers (*, #, _, ?) and symbolic
    arithmetic (`K+1`) stripped, `...` and fixed sizes dropped."""
    names = []
    for dim in dims.split():
        if dim == "...":
            continue
        names += [n for n in re.findall(r"[A-Za-z_]\w*", dim.lstrip("*#?")) if n != "_"]
    return names


def test_shape_strings_use_the_alphabet():
    seen, bad = 0, []
    for path in _sources():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for dims in HINT.findall(line):
                seen += 1
                bad += [f"{path.relative_to(ROOT)}:{lineno}: {n!r} in {dims!r}" for n in _names(dims) if n not in DIMS]
    assert seen > 50, f"found only {seen} shape strings: has the pattern gone stale?"
    assert not bad, "dimension names outside the alphabet (specjax.models.llama):\n" + "\n".join(bad)


def test_einsum_strings_use_the_alphabet():
    seen, bad = 0, []
    for path in _sources():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for spec in EINSUM_CALL.findall(line):
                seen += 1
                bad += [f"{path.relative_to(ROOT)}:{lineno}: {c!r} in {spec!r}"
                        for c in re.sub(r"\.\.\.|[,\->\s]", "", spec) if c not in EINSUM]
    assert seen > 5, f"found only {seen} einsum strings: has the pattern gone stale?"
    assert not bad, "einsum letters outside the alphabet (specjax.models.llama):\n" + "\n".join(bad)


def test_the_alphabet_is_the_model_files():
    """The names here are the ones the model file documents, no more."""
    doc = (ROOT / "models" / "llama.py").read_text().split('"""')[1]
    documented = set(re.findall(r"\b([A-Z][a-z]?) (?=[a-z])", doc))
    assert DIMS <= documented, sorted(DIMS - documented)


def test_the_checker_sees_a_stray_letter():
    assert _names("B K+1 V") == ["B", "K", "V"]
    assert _names("B *T V") == ["B", "T", "V"]
    assert "X" not in DIMS and _names("... X") == ["X"]
