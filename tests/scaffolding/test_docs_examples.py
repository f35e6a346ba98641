"""The docs-examples harness (tests/docs_examples.py): every fenced block of the docs is run or listed,
and its checks fail where they should: a new block of any tag is run or reported, each block's own
`# ->` lines are checked, a wrong one fails its run. The examples themselves run against a real
server in tests/serve/test_config_yaml.py, through the same `audit`, `run_curl` and `run_python`."""

from __future__ import annotations

import os
import re

import pytest
import yaml

from tests import docs_examples as dx

ANSWER = {
    "choices": [
        {
            "message": {"content": "Paris."},
            "hidden_states": [0.5] * 4,
            "hidden_states_meta": {"positions": [5, 6, 7], "shape": [3, 4], "dtype": "float16"},
        }
    ],
    "rows": "AAAAAAAAAAAAAAAA",
}  # 12 bytes
ENV = {**os.environ, "PYTHONPATH": str(dx.ROOT)}


def with_block(doc: str, fence: str, code: str) -> list[dx.Block]:
    """The docs' blocks as they are, and one more at the end of `doc`."""
    path = dx.ROOT / doc
    text = path.read_text(encoding="utf-8") + f"\n{fence}\n{code}\n```\n"
    return [b for b in dx.blocks() if b.doc != doc] + dx.blocks_of(doc, text)


def the_new(found: list[dx.Example], code: str) -> list[dx.Example]:
    return [e for e in found if e.code == code]


def example(code: str, kind: str = "python", doc: str = "docs/new.md", line: int = 10) -> dx.Example:
    return dx.Example(doc, line, "python" if kind == "python" else "sh", code, kind=kind)


# -- the curl shapes and the Python checks ------------------------------------------------------


@pytest.mark.parametrize(
    "want, problems",
    [
        ('"content": "Paris.", "hidden_states": [4 floats], ...', []),
        ('"hidden_states_meta": {"positions": [5, ..., 7], "shape": [3, 4], "dtype": "float16", ...}', []),
        ('"rows": "<base64 of float16 [2, 3]>"', []),
        ('"content": "Rome."', ["content: 'Paris.' != 'Rome.'"]),
        ('"hidden_states": [5 floats]', ["hidden_states: not 5 floats"]),
        ('"hidden_states_meta": {"positions": [4, ..., 7]}', ["does not run"]),
        ('"rows": "<base64 of float32 [2, 3]>"', ["12 bytes of base64, not 24"]),
        ('"usage": {...}', ["no 'usage' in the answer"]),
    ],
)
def test_curl_shapes_pass_and_fail(want, problems):
    got = dx.problems(ANSWER, want)
    assert len(got) == len(problems) and all(p in g for p, g in zip(problems, got)), got


def test_python_expectations_become_checks_that_can_fail():
    code = "x = (7, 576)\nx  # -> (..., 576)\nlen(x)  # -> 2\n"
    exec(dx.PRELUDE + dx.checked_python(code), {})
    with pytest.raises(AssertionError, match="line 2"):
        exec(dx.PRELUDE + dx.checked_python(code.replace("576)\n", "575)\n", 1)), {})
    with pytest.raises(AssertionError, match="line 3"):
        exec(dx.PRELUDE + dx.checked_python(code.replace("# -> 2", "# -> 3")), {})
    # a multi-line expression's check is on its last line; `->` inside a string is not a check
    assert sorted(dx.python_checks("(1 +\n 2)  # -> 3\ns = '# -> 4'\n")) == [2]


# -- every block runs or is listed -----------------------------------------------------------------


def test_every_fenced_block_of_the_docs_runs_or_is_listed():
    found, problems = dx.audit()
    assert problems == [], "\n".join(problems)
    named, _ = dx.listing(dx.blocks())
    runs = {(e.doc, e.line) for e in found}
    assert all((b.doc, b.line) in runs or b in named for b in dx.blocks())
    assert {e.kind for e in found} == {"curl", "python", "batch"}, found
    # the examples the serve test counted before this rule, and no fewer
    assert len(found) >= 11 and sum(e.kind == "python" for e in found) >= 6


def test_fences_of_any_form_are_blocks():
    text = (
        "a\n```python title=x.py\n1  # -> 1\n```\n  ~~~bash\n  curl -s localhost:8000\n  ~~~\n"
        "````md\n```sh\nnot a block of its own\n```\n````\n```sh\nleft open\n"
    )
    found = dx.blocks_of("docs/x.md", text)
    assert [(b.line, b.lang, b.first) for b in found] == [
        (2, "python", "1  # -> 1"),
        (5, "bash", "curl -s localhost:8000"),
        (8, "md", "```sh"),
        (13, "sh", "left open"),
    ]


@pytest.mark.parametrize(
    "code",
    [
        'curl -s localhost:8000/v1/models\n# -> "object": "list"',
        'curl -s http://127.0.0.1:8000/v1/models | python -m json.tool\n# -> "object": "list"',
    ],
)
def test_a_new_bash_curl_block_is_an_example(code):
    found, problems = dx.audit(with_block("README.md", "```bash", code))
    assert [e.kind for e in the_new(found, code)] == ["curl"] and problems == []


def test_a_new_block_that_is_no_example_is_reported_until_listed():
    code = "export HIDDEN_STATES_CACHE=/data/models\nmake serve"
    found = with_block("docs/operations.md", "```bash", code)
    examples, problems = dx.audit(found)
    assert not the_new(examples, code)
    assert len(problems) == 1 and "neither runs nor lists" in problems[0] and "```bash" in problems[0], problems
    listed = {**dx.LISTED, ("docs/operations.md", "export HIDDEN_STATES_CACHE"): (dx.NOT_RUN, "moves the cache")}
    assert dx.audit(found, listed)[1] == []
    for fence in ("```", "```text", "```yaml", "```console"):  # no tag, or one the harness cannot run
        assert any("neither runs nor lists" in p for p in dx.audit(with_block("README.md", fence, "x: 1"))[1])


def test_an_openai_import_block_is_an_example_and_must_show_its_answer():
    code = (
        'from openai import OpenAI\nclient = OpenAI(base_url="http://localhost:8000/v1", api_key="unused")\n'
        "r = client.models.list()"
    )
    found, problems = dx.audit(with_block("docs/api.md", "```python", code))
    assert [e.kind for e in the_new(found, code)] == ["python"]
    # the doc's other blocks show their answers: this one must show its own
    assert len(problems) == 1 and "shows no answer" in problems[0], problems
    shown = code + "\n[m.id for m in r.data]  # -> ['smollm2-135m-instruct']"
    assert dx.audit(with_block("docs/api.md", "```python", shown))[1] == []


def test_a_block_listed_as_set_up_runs_without_an_answer_of_its_own():
    code = 'from openai import OpenAI\nclient = OpenAI(base_url="http://localhost:8000/v1", api_key="unused")'
    listed = {**dx.LISTED, ("docs/api.md", "from openai import OpenAI"): (dx.SET_UP, "the next block's client")}
    found, problems = dx.audit(with_block("docs/api.md", "```py", code), listed)
    assert problems == [] and [e.set_up for e in the_new(found, code)] == [True]


@pytest.mark.parametrize(
    "code, why",
    [
        ("x = 1 + 1  # -> 2", "cannot check"),  # on an assignment
        ("for i in range(2):\n    i  # -> 0", "cannot check"),  # inside a loop
        ("1 + 1\n# -> 2", "cannot check"),  # on a line of its own
        ("import math", "shows no answer"),
    ],
)
def test_a_python_arrow_that_would_not_be_checked_is_a_problem(code, why):
    problems = dx.audit(with_block("README.md", "```python", code))[1]
    assert problems and why in problems[0], problems  # (and: it shows no answer that is checked)


def test_a_curl_block_must_show_its_answer_as_comment_lines():
    assert "shows no answer" in dx.audit(with_block("README.md", "```sh", "curl -s localhost:8000/v1/models"))[1][0]
    trailing = 'curl -s localhost:8000/v1/models  # -> "object": "list"'
    assert any("cannot check" in p for p in dx.audit(with_block("README.md", "```sh", trailing))[1])
    assert any(
        'not a `"key": value` item' in p
        for p in dx.audit(with_block("README.md", "```sh", "curl -s localhost:8000/v1/models\n# -> object is a list"))[
            1
        ]
    )


def test_the_list_names_each_of_its_blocks_once():
    stale = {**dx.LISTED, ("README.md", "make install"): (dx.NOT_RUN, "gone")}
    assert any("names 0 blocks" in p for p in dx.audit(listed=stale)[1])
    # a new block that starts as a listed one does is not skipped under its entry
    twin = with_block("docs/how-it-works.md", "```python", "import torch\ntorch.zeros(2).shape  # -> (2,)")
    assert any("names 2 blocks" in p for p in dx.audit(twin)[1])
    odd = {**dx.LISTED, ("README.md", "make serve "): ("skip", "")}
    assert any("'skip' is neither 'not run' nor 'set-up'" in p for p in dx.audit(listed=odd)[1])


# -- breaking the harness: the checks above then fail -----------------------------------------------


def old_kind_of(block: dx.Block) -> str | None:
    """The harness before this rule (21bc6e3): examples by the `sh`/`python` tag, `localhost:8000` and
    `openai.`/`httpx.`/`deployments.client`."""
    if block.lang == "sh" and "deployments.batch" in block.code:
        return "batch"
    if block.lang == "sh" and re.search(r"\bcurl\b.*localhost:8000", block.code):
        return "curl"
    if block.lang == "python" and re.search(r"openai\.|httpx\.|deployments\.client", block.code):
        return "python"
    return None


def test_a_harness_that_drops_examples_by_their_tag_is_caught(monkeypatch):
    """With the old classifier, a `bash` curl block and a `from openai import OpenAI` block are no
    examples: the audit reports each as a block neither run nor listed."""
    monkeypatch.setattr(dx, "kind_of", old_kind_of)
    bash = 'curl -s localhost:8000/v1/models\n# -> "object": "list"'
    found, problems = dx.audit(with_block("README.md", "```bash", bash))
    assert not the_new(found, bash) and any("neither runs nor lists" in p and "```bash" in p for p in problems)
    sdk = "from openai import OpenAI\nOpenAI(api_key=\"x\").api_key  # -> 'x'"
    found, problems = dx.audit(with_block("docs/api.md", "```python", sdk))
    assert not the_new(found, sdk) and any("neither runs nor lists" in p for p in problems)


def test_a_harness_that_lists_every_block_is_caught(monkeypatch):
    """Listing is by name, one block each: an entry that would match every block names more than one."""
    monkeypatch.setattr(dx, "LISTED", {**dx.LISTED, ("README.md", ""): (dx.NOT_RUN, "everything")})
    readme = sum(b.doc == "README.md" for b in dx.blocks())
    assert f"LISTED['README.md', ''] names {readme} blocks, not one" in "\n".join(dx.audit()[1])


def test_a_harness_that_drops_a_check_is_caught(monkeypatch):
    """If the converter lost a `# ->` (here: the last of each block), the audit names its line."""
    real = dx.python_checks
    monkeypatch.setattr(dx, "python_checks", lambda code: dict(sorted(real(code).items())[:-1]))
    problems = dx.audit()[1]
    assert any(re.match(r"README\.md:\d+: line \d+: a `# ->` the harness cannot check", p) for p in problems), problems


# -- running them: what the serve test calls, on blocks that need no server ---------------------------


def test_a_wrong_python_arrow_fails_its_run_naming_the_doc_s_line(tmp_path):
    good = example("x = sum([1, 2])\nx  # -> 3\n(x, 576)  # -> (..., 576)")
    assert dx.run_python([good], ENV, tmp_path) == []
    wrong = example("x = sum([1, 2])\nx  # -> 4\n(x, 576)  # -> (..., 576)")
    (problem,) = dx.run_python([good, wrong], ENV, tmp_path)
    assert problem.startswith("docs/new.md:10: failed") and "line 12: 3 != 4" in problem, problem
    pattern = example("x = sum([1, 2])\nx  # -> 3\n(x, 576)  # -> (..., 577)")
    (problem,) = dx.run_python([pattern], ENV, tmp_path)
    assert "line 13: (3, 576) is not what the docs show" in problem, problem


def test_each_block_s_checks_must_run(tmp_path):
    """A run that ends early with status 0 leaves checks unrun: each is a problem."""
    first = example("x = 3\nx  # -> 3")
    ends = example("import os\nx  # -> 3\nos._exit(0)\nx + 1  # -> 4", line=20)
    assert dx.run_python([first, ends], ENV, tmp_path) == [
        "docs/new.md:24: its check did not run (the run ended before it, exit status 0)"
    ]


def test_a_curl_block_s_answer_is_checked(monkeypatch):
    """`run_curl` runs the block with bash and checks its stdout against its `# ->` lines: an `echo`
    stands for the server here."""
    answer = """echo '{"object": "list", "data": [{"id": "m"}]}'"""
    ok = example(answer + '\n# -> "object": "list", "id": "m"', kind="curl")
    assert dx.run_curl(ok, ENV) == []
    wrong = example(answer + '\n# -> "object": "list",\n#    "id": "smollm2"', kind="curl")
    assert dx.run_curl(wrong, ENV) == ["docs/new.md:10: id: 'm' != 'smollm2'"]
    error = example("""echo '{"error": {"message": "no"}}'\n# -> "message": "no\"""", kind="curl")
    assert dx.run_curl(error, ENV) == ["docs/new.md:10: an error: {'message': 'no'}"]
    assert "not a JSON answer" in dx.run_curl(example('echo not json\n# -> "a": 1', kind="curl"), ENV)[0]


# -- what the docs hold ------------------------------------------------------------------------------


def test_the_docs_have_the_newcomer_s_examples():
    found = dx.examples()
    assert all(e.kind != "curl" or dx.expectation(e.code) for e in found), "a curl example shows no answer"
    assert any("messages=" in e.code and "complete(" in e.code for e in found), "no handle call with chat messages"


def test_handle_examples_name_the_app_the_configs_serve():
    """`serve.get_app_handle(NAME)` in the docs finds the app `serve run config.yaml` and the cluster's
    `serve deploy` config deploy."""
    names = {
        app["name"]
        for path in ("config.yaml", "cluster/serve-gpu.yaml")
        for app in yaml.safe_load((dx.ROOT / path).read_text())["applications"]
    }
    used = {
        m.group(1) for path in dx.doc_files() for m in re.finditer(r'get_app_handle\("([^"]+)"\)', path.read_text())
    }
    assert used and names == used, (names, used)
