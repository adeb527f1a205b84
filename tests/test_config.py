"""`specjax.methods.config`: `SpecConfig`'s checks and what it derives (tree, k, window, n-gram table), and the
`--tree` flag's parser."""

import pytest

from specjax.core.ngram_table import TableConfig
from specjax.methods.config import MAX_K, TREES, SpecConfig, parse_tree
from specjax.methods.ngram.options import NgramOptions


@pytest.mark.parametrize("kw, match", [
    (dict(method="ngram", k=0), "k=0"),
    (dict(method="draft", k=MAX_K + 1), f"k={MAX_K + 1}"),
    (dict(method="ngram", k=2.5), "k=2.5"),
    (dict(method="ngram", ngram_min=3, ngram_max=2), "ngram_min"),
    (dict(method="ngram", ngram_min=0), "ngram_min"),
    (dict(method="hydra"), "unknown method"),
    (dict(method="ngram", tree="small"), "'medusa' or 'recycle' only"),
    (dict(method="medusa", tree="huge"), "unknown tree"),
    (dict(method="medusa", tree=((0,), (1, 0))), "parent"),
    (dict(method="medusa", tree=((0,), (0,))), "twice"),
    (dict(method="medusa", typical=(0.3, 2.0)), "typical"),
])
def test_bad_spec_config(kw, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig.make(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(method="ngram", k=-1), r"k=-1: must be an integer in \[1, 16\]"),
    (dict(method="medusa", tree="huge"), "unknown tree 'huge': use one of chain4, small, medium"),
    (dict(method="eagle", k=3, nodes=65), "nodes=65: at most 64"),
    (dict(method="eagle", k=3, nodes=2.5), "nodes=2.5"),
    (dict(method="eagle", k=3, topk=0), "topk=0"),
    (dict(method="ngram", ngram_table=-1), "ngram_table=-1"),
    (dict(typical=(0.3, 0.1)), "give a speculative method"),
])
def test_bad_options_name_themselves(kw, match):
    """Each refusal is a ValueError naming the option and its bad value."""
    with pytest.raises(ValueError, match=match):
        SpecConfig.make(**kw)


def test_trees_resolve_and_set_k():
    named = SpecConfig.make("medusa", tree="small")
    assert named.options.tree == TREES["small"] and named.k == 4
    assert named.is_tree and named == SpecConfig.make("medusa", tree=TREES["small"], k=2)  # k from the tree
    listed = SpecConfig.make("medusa", tree=[[0], [1], [0, 0]])  # as JSON gives it
    assert listed.options.tree == ((0,), (1,), (0, 0)) and listed.k == 2
    hash(listed)  # jit-static: hashable once normalised
    chain = SpecConfig(method="ngram", k=3)
    assert not chain.is_tree and chain.depth == 3 and SpecConfig.make("eagle", k=3, nodes=8).is_tree
    assert SpecConfig.make("medusa", tree="heads").options.tree == "heads"  # resolved by the Engine


def test_parse_tree():
    assert parse_tree(None) is None
    assert parse_tree("small") == "small"  # a name: SpecConfig resolves it
    assert parse_tree(" [[0], [1], [0, 0]]") == ((0,), (1,), (0, 0))
    assert SpecConfig.make("medusa", tree=parse_tree("[[0],[0,0]]")).k == 2


def test_table_config():
    from specjax.core.decoder import Decoder

    proposer = lambda **kw: SpecConfig.make("ngram", **kw)
    assert SpecConfig.make("ngram", k=4).options.ngram_table == 0  # off by default
    spec = SpecConfig.make("ngram", k=4, ngram_table=128, ngram_min=1, ngram_max=3)
    assert spec.options == NgramOptions(ngram_table=128)
    from specjax.methods import registry

    table = registry.build(spec, None)[0].table
    assert table == TableConfig(size=128, width=4, min_n=2, max_n=3)  # no 1-grams across requests
    assert registry.build(proposer(ngram_table=8, ngram_min=1, ngram_max=1), None)[0].table.min_n == 1
    assert registry.build(proposer(k=4), None)[0].shared == ()
    assert Decoder(cache_length=32, proposer=registry.build(spec, None)[0]).shared == (table,)


def test_options_belong_to_their_method():
    """A method's own options are its dataclass's fields: `make` routes keywords there, another
    method's option is refused by name, a wrong dataclass too."""
    assert SpecConfig(method="ngram") == SpecConfig(method="ngram", options=NgramOptions())
    assert SpecConfig.make("ngram", k=2, ngram_max=5).with_options(ngram_max=4).options.ngram_max == 4
    with pytest.raises(ValueError, match="ngram_table= applies to method 'ngram' only"):
        SpecConfig.make("medusa", ngram_table=64)
    with pytest.raises(ValueError, match="unknown option bogus="):
        SpecConfig.make("ngram", bogus=1)
    with pytest.raises(ValueError, match="takes NgramOptions"):
        SpecConfig(method="ngram", options=TableConfig())
    with pytest.raises(ValueError, match="takes no options"):
        SpecConfig(method="draft", options=NgramOptions())
