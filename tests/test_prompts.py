"""`specjax.bench.prompts`: prompt files and the prompt sets shipped in the package, read by name."""

import json
import pathlib
import tomllib

import jsonschema
import pytest

from specjax.bench import prompts
from specjax.bench.prompts import read_prompts

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPEC_BENCH = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def test_the_task_set_has_spec_benchs_six_classes():
    got = read_prompts("tasks")
    assert {t: sum(p.task == t for p in got) for t in SPEC_BENCH} == {t: 8 for t in SPEC_BENCH}
    assert len({p.id for p in got}) == len(got) == 48 and all(p.text.strip() for p in got)
    assert [p.task for p in read_prompts("tasks", per_task=1)] == ["mt_bench", "translation", "summarization",
                                                                  "qa", "math_reasoning", "rag"]


def test_the_ops_set_has_configuration_and_diagnostic_classes():
    got = read_prompts("ops")
    assert len(got) == 24 and sum(p.task == "config" for p in got) == 14
    assert sum(p.task == "diagnostic" for p in got) == 10
    assert [p.task for p in read_prompts("ops", per_task=2, tasks=("diagnostic",))] == ["diagnostic"] * 2


def test_the_demo_set_is_an_edit_a_schema_request_and_an_open_question():
    """`make run`'s prompts: an edit whose file is its prediction, a request under a JSON schema (the
    same file's settings; a valid answer exists), an open question with neither."""
    got = read_prompts(prompts.DEMO)
    assert [(p.id, p.task) for p in got] == [("demo-config", "configuration request"),
                                             ("demo-schema", "configuration as JSON"),
                                             ("demo-question", "open question")]
    edit, schema, question = got
    assert edit.prediction and edit.prediction in edit.text and edit.response_format is None
    assert schema.prediction is None and schema.response_format["type"] == "json_schema"
    answer = {"server": {"host": "0.0.0.0", "port": 9090, "workers": 4}, "logging": {"level": "info", "format": "json"},
              "database": {"host": "inventory-db", "port": 5432, "name": "inventory"}}
    jsonschema.validate(answer, schema.response_format["json_schema"]["schema"])
    assert question.prediction is None and question.response_format is None and question.regex is None


@pytest.mark.parametrize("line, match", [
    ('{"turns": ["x"], "response_format": "json"}', "response_format must be an object"),
    ('{"turns": ["x"], "regex": 3}', "regex must be a string"),
])
def test_a_malformed_constraint_in_a_prompt_file_is_refused_by_line(tmp_path, line, match):
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=f"p.jsonl:1: malformed prompt line.*{match}"):
        read_prompts(path)


@pytest.mark.parametrize("name", prompts.SHIPPED)
def test_every_shipped_set_is_package_data_in_spec_bench_shape(name):
    path = prompts.shipped(name)
    assert path.parent == ROOT / "specjax" / "bench" / "data"
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        assert {"question_id", "task", "turns"} <= set(row) and row["turns"][0].strip()
    # a wheel carries them: the package data glob names each file
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(path.match(f"specjax/bench/{g}") for g in globs["specjax.bench"])


def test_a_file_is_read_as_before_and_wins_over_a_shipped_name(tmp_path, monkeypatch):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"question_id": 7, "task": "qa", "turns": ["Why is the sky blue?"]}\n')
    assert read_prompts(f) == [prompts.Prompt(id=7, text="Why is the sky blue?", task="qa")]
    (tmp_path / "ops").write_text("a plain line\n")
    monkeypatch.chdir(tmp_path)
    assert [p.text for p in read_prompts("ops")] == ["a plain line"]


def test_an_unknown_name_says_which_sets_ship():
    with pytest.raises(ValueError, match=r"'nope' does not exist \(give a file, or a shipped set: tasks, ops, demo, edits\)"):
        read_prompts("nope")
    with pytest.raises(ValueError, match="no shipped prompt set 'nope'"):
        prompts.shipped("nope")
