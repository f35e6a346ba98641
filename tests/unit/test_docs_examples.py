"""The docs-examples harness (tests/docs_examples.py) finds the examples and its checks can fail.
The examples themselves run against a real server in tests/serve/test_config_yaml.py."""

from __future__ import annotations

import re

import pytest
import yaml

from tests import docs_examples as dx

ANSWER = {"choices": [{"message": {"content": "Paris."}, "hidden_states": [0.5] * 4,
                       "hidden_states_meta": {"positions": [5, 6, 7], "shape": [3, 4], "dtype": "float16"}}],
          "rows": "AAAAAAAAAAAAAAAA"}  # 12 bytes


@pytest.mark.parametrize("want, problems", [
    ('"content": "Paris.", "hidden_states": [4 floats], ...', []),
    ('"hidden_states_meta": {"positions": [5, ..., 7], "shape": [3, 4], "dtype": "float16", ...}', []),
    ('"rows": "<base64 of float16 [2, 3]>"', []),
    ('"content": "Rome."', ["content: 'Paris.' != 'Rome.'"]),
    ('"hidden_states": [5 floats]', ["hidden_states: not 5 floats"]),
    ('"hidden_states_meta": {"positions": [4, ..., 7]}', ["does not run"]),
    ('"rows": "<base64 of float32 [2, 3]>"', ["12 bytes of base64, not 24"]),
    ('"usage": {...}', ["no 'usage' in the answer"]),
])
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


def test_the_docs_have_the_newcomer_s_examples():
    found = dx.examples()
    kinds = {e.kind for e in found}
    assert kinds == {"curl", "python", "batch"}, found
    assert all(e.kind != "curl" or dx.expectation(e.code) for e in found), "a curl example shows no answer"
    assert any("messages=" in e.code and "complete(" in e.code for e in found), "no handle call with chat messages"


def test_handle_examples_name_the_app_the_configs_serve():
    """`serve.get_app_handle(NAME)` in the docs finds the app `serve run config.yaml` and the cluster's
    `serve deploy` config deploy."""
    names = {app["name"] for path in ("config.yaml", "cluster/serve-gpu.yaml")
             for app in yaml.safe_load((dx.ROOT / path).read_text())["applications"]}
    used = {m.group(1) for path in dx.doc_files() for m in re.finditer(r'get_app_handle\("([^"]+)"\)',
                                                                        path.read_text())}
    assert used and names == used, (names, used)
