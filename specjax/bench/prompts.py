"""Prompt files: Spec-Bench-shaped JSON lines, or plain text (one prompt per line), and the prompt sets
the package ships.

The shipped sets were written for this project (`specjax/bench/data/`, package data), so the commands,
tests and notebooks run from a bare clone or an installed wheel; any file works in their place:
- `tasks`: Spec-Bench's six task classes (mt_bench, translation, summarization, qa, math_reasoning,
  rag), 8 prompts each;
- `ops`: an operations assistant's two classes, configuration files (`config`, 14) and diagnostic
  questions (`diagnostic`, 10);
- `demo`: the three prompts of `specjax generate --demo` (`make run`): a configuration edit with the
  file as its prediction, a configuration request under a JSON schema, and an open question;
- `edits`: configuration edits, each with its file as the prediction (method `predict`).

Example:
  >>> [p.task for p in read_prompts("demo")]
  ['configuration request', 'configuration as JSON', 'open question']
  >>> len(read_prompts("tasks", per_task=2, tasks=("qa", "rag")))
  4
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import pathlib

SHIPPED = ("tasks", "ops", "demo", "edits")  # the sets under specjax/bench/data/, by name
DEMO = "demo"


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str | int
    text: str
    task: str | None = None
    prediction: str | None = None  # the text its answer is expected to restate (`prediction`), if any
    response_format: dict | None = None  # OpenAI's response_format its answer follows (json_schema), if any
    regex: str | None = None  # a regular expression its whole answer matches, if any (the server's extension)


def shipped(name: str) -> pathlib.Path:
    """The file of the shipped prompt set `name` (one of `SHIPPED`)."""
    if name not in SHIPPED:
        raise ValueError(f"no shipped prompt set {name!r}: the shipped sets are {', '.join(SHIPPED)}")
    return pathlib.Path(str(importlib.resources.files(__package__) / "data" / f"{name}.jsonl"))


def resolve(path: str | pathlib.Path) -> pathlib.Path:
    """A prompt file: `path` where such a file exists, else the shipped set of that name."""
    given = pathlib.Path(path)
    if given.is_file():
        return given
    if str(path) in SHIPPED:
        return shipped(str(path))
    raise ValueError(f"prompt file {str(path)!r} does not exist (give a file, or a shipped set: "
                     f"{', '.join(SHIPPED)})")


def read_prompts(path: str | pathlib.Path, *, per_task: int | None = None,
                 tasks: tuple[str, ...] | None = None) -> list[Prompt]:
    """Reads prompts from `path`: a file, or the name of a shipped set (`SHIPPED`; a file of that
    name wins).

    JSON lines in the shape of Spec-Bench's question file (`question_id`, `task`, `turns`: the
    first turn is the prompt; `prediction`, optional: the text its answer is expected to restate,
    for method predict; `response_format` (OpenAI's) or `regex`, optional: a constraint its answer
    follows), or plain text lines. Blank lines are skipped.

    Args:
      per_task: keep only the first N prompts of each task class.
      tasks: keep only these task classes.
    """
    path = resolve(path)
    lines = [(i, ln) for i, ln in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if ln.strip()]
    if not lines:
        raise ValueError(f"prompt file {str(path)!r} is empty: give JSON lines or one prompt per line")
    as_json = lines[0][1].lstrip().startswith("{")
    prompts = []
    for lineno, ln in lines:
        if not as_json:
            prompts.append(Prompt(id=lineno, text=ln))
            continue
        try:
            obj = json.loads(ln)
            turns = obj["turns"]
            text = turns[0] if isinstance(turns, list) else turns
            if not isinstance(text, str) or not text:
                raise ValueError("empty first turn")
            if not isinstance(obj.get("prediction", ""), str):
                raise ValueError("prediction must be a string")
            if not isinstance(obj.get("response_format", {}), dict):
                raise ValueError('response_format must be an object, e.g. {"type": "json_schema", ...}')
            if not isinstance(obj.get("regex", ""), str):
                raise ValueError("regex must be a string")
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(
                f"{path}:{lineno}: malformed prompt line ({type(e).__name__}: {e}); expected a JSON "
                'object like {"question_id": 1, "task": "qa", "turns": ["..."]}'
            ) from e
        prompts.append(Prompt(id=obj.get("question_id", lineno), text=text, task=obj.get("task"),
                              prediction=obj.get("prediction"), response_format=obj.get("response_format"),
                              regex=obj.get("regex")))
    if tasks:
        prompts = [p for p in prompts if p.task in tasks]
    if per_task:
        seen: dict[str | None, int] = {}
        kept = []
        for p in prompts:
            seen[p.task] = seen.get(p.task, 0) + 1
            if seen[p.task] <= per_task:
                kept.append(p)
        prompts = kept
    return prompts


def bench_prompts(path: str | None, *, per_task: int | None, tasks: str | None, default: str) -> list[Prompt]:
    """The prompts of a bench run: `path` filtered by task (comma-separated) and per-task count, or
    one `default` prompt when no file is given."""
    if not path:
        return [Prompt(id=1, text=default, task="synthetic")]
    keep = tuple(t.strip() for t in tasks.split(",")) if tasks else None
    prompts = read_prompts(path, per_task=per_task, tasks=keep)
    if not prompts:
        raise ValueError(f"no prompts left in {path} after --tasks/--per-task filtering")
    return prompts


def check_output_paths(*paths: str | None) -> None:
    """Creates the folders output files will go to, before any work is done; raises one clear error
    when one cannot be written there."""
    for path in paths:
        if not path:
            continue
        parent = pathlib.Path(path).expanduser().resolve().parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot write {path}: its folder {parent} cannot be created ({e})") from None
        if pathlib.Path(path).is_dir():
            raise ValueError(f"{path} is a folder: give a file path")
