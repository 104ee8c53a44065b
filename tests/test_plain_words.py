"""Plain words in what users read (issue 15): no protocol phase names ("save planning:") in
errors, plurals right ("1 object"), the optimizer hints only when an optimizer is involved, and
``allow_pickle`` suggested only for values pickle can hold."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest
import torch

import cloudckpt
from cloudckpt.errors import (
    CheckpointExists,
    CheckpointNotFound,
    MissingKeysError,
    UnsupportedValueError,
)
from cloudckpt.manifest.values import encode_value
from cloudckpt.planning.load.hints import (
    is_optimizer_name,
    missing_names_message,
    unexpected_names_message,
)
from cloudckpt.wording import PHASE_WORDS, phase_words, plural, ranks_phrase
from tests.cli_forkserver import run_cli
from tests.reliability.stores import REPO, cli_env

PACKAGE = Path(cloudckpt.__file__).parent


def test_plural_and_ranks():
    assert [plural(n, "object") for n in (0, 1, 2)] == ["0 objects", "1 object", "2 objects"]
    assert plural(1, "leaf", "leaves") == "1 leaf" and plural(3, "leaf", "leaves") == "3 leaves"
    assert ranks_phrase([1]) == "rank 1" and ranks_phrase([2, 0]) == "ranks 0, 2"


def _string_literals(tree: ast.AST):
    """Every string constant of a module that is not a docstring."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            yield node


def test_no_message_writes_a_plural_with_parentheses():
    """Generated over the whole package: no string literal says "key(s)" or "rank(s)"."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in _string_literals(ast.parse(path.read_text())):
            if re.search(r"[a-z]\(s\)", node.value):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    assert found == []


def test_every_phase_has_plain_words():
    """Every phase name the package passes to ``agree``/``phase`` has words without protocol
    jargon ("planning", "upload", "commit")."""
    names = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("agree", "phase")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(node.args[0].value)
    assert names, "no phase found"
    for name in names:
        words = phase_words(name)
        assert not re.search(r"planning|upload|commit|staging", words), (name, words)
    assert set(PHASE_WORDS.values()) <= {phase_words(n) for n in PHASE_WORDS}


def test_one_process_errors_read_plainly(tmp_path):
    with pytest.raises(CheckpointNotFound) as missing:
        cloudckpt.load({"a": torch.zeros(2)}, str(tmp_path / "nope"))
    assert str(missing.value).startswith("loading (reading the manifest): no committed checkpoint")
    cloudckpt.save({"a": torch.ones(2)}, str(tmp_path / "ck"))
    with pytest.raises(CheckpointExists) as exists:
        cloudckpt.save({"a": torch.ones(2)}, str(tmp_path / "ck"))
    assert str(exists.value).startswith("saving: a checkpoint is already committed at ")
    with pytest.raises(MissingKeysError) as keys:
        cloudckpt.load({"b": torch.zeros(2)}, str(tmp_path / "ck"))
    assert str(keys.value).startswith("loading: 1 name is not in the checkpoint: 'b' (")


def _model_and_optimizer(step: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    if step:
        model(torch.ones(1, 3)).sum().backward()
        optim.step()
    return model, optim


def test_optimizer_names():
    model, optim = _model_and_optimizer(step=True)
    from cloudckpt.statedict.flatten import flatten_state_dict

    flat = flatten_state_dict({"model": model.state_dict(), "optim": optim.state_dict()})
    names = list(flat.tensors) + list(flat.values)
    assert {n for n in names if is_optimizer_name(n)} == {
        n for n in names if n.startswith("optim.")
    }
    assert not is_optimizer_name("model.state.weight") and not is_optimizer_name("step")


def test_missing_names_hint_mentions_the_optimizer_only_for_optimizer_state(tmp_path):
    model, optim = _model_and_optimizer(step=False)
    url = str(tmp_path / "before-first-step")
    cloudckpt.save({"model": model.state_dict(), "optim": optim.state_dict()}, url)
    model2, optim2 = _model_and_optimizer(step=True)  # has Adam state the checkpoint lacks
    with pytest.raises(MissingKeysError) as err:
        cloudckpt.load({"model": model2.state_dict(), "optim": optim2.state_dict()}, url)
    text = str(err.value)
    assert "optimizer entries" in text and "strict=False" in text, text
    with pytest.raises(MissingKeysError) as err:
        cloudckpt.load({"model": model2.state_dict(), "extra": torch.zeros(1)}, url)
    assert "optimizer" not in str(err.value) and "1 name is not" in str(err.value)
    assert "optimizer" not in missing_names_message(["a", "b"])
    assert missing_names_message([f"n{i}" for i in range(10)]).count("'n") == 8  # and 2 more


def test_unexpected_names_warning_hints_at_a_fresh_optimizer_only_then(tmp_path, caplog):
    model, optim = _model_and_optimizer(step=True)
    url = str(tmp_path / "ck")
    cloudckpt.save({"model": model.state_dict(), "optim": optim.state_dict()}, url)
    caplog.set_level(logging.WARNING, logger="cloudckpt")

    fresh_model, fresh_optim = _model_and_optimizer(step=False)  # no Adam state yet
    cloudckpt.load({"model": fresh_model.state_dict(), "optim": fresh_optim.state_dict()}, url)
    fresh = [r.getMessage() for r in caplog.records if "not requested" in r.getMessage()]
    assert len(fresh) == 1 and "has no state to fill yet" in fresh[0], fresh
    caplog.clear()

    cloudckpt.load({"model": fresh_model.state_dict()}, url)  # the optimizer not asked for
    only_model = [r.getMessage() for r in caplog.records if "not requested" in r.getMessage()]
    assert len(only_model) == 1 and "optimizer" not in only_model[0], only_model
    assert unexpected_names_message(["x"]).startswith(
        "1 stored name was not requested and stays unloaded: 'x'"
    )


def test_allow_pickle_is_suggested_only_for_values_pickle_can_hold(tmp_path):
    def local_function():
        return 1

    class Local:
        pass

    for value in (lambda x: x, local_function, Local(), __import__("threading").Lock()):
        with pytest.raises(UnsupportedValueError) as err:
            encode_value({"v": value}, key="cfg", allow_pickle=False)
        text = str(err.value)
        assert "allow_pickle would not help" in text and "pass allow_pickle=True" not in text
        assert " at 0x" not in text  # no memory addresses: the same text on every rank
    for value in ({1, 2}, frozenset({3}), complex(1, 2), Path("/x")):
        with pytest.raises(UnsupportedValueError) as err:
            encode_value(value, key="cfg", allow_pickle=False)
        assert "pass allow_pickle=True (on save and on load)" in str(err.value)
    with pytest.raises(UnsupportedValueError) as err:
        cloudckpt.save({"w": torch.ones(1), "fn": lambda: 0}, str(tmp_path / "ck"))
    assert "allow_pickle would not help" in str(err.value) and "'fn'" in str(err.value)
    assert str(err.value).startswith("saving: ")


def test_cli_counts_read_plainly(tmp_path):
    url = str(tmp_path / "ck")
    cloudckpt.save({"w": torch.ones(4)}, url)

    def run(*args):
        res = run_cli(args, cwd=REPO, env=cli_env(None), timeout=120)
        assert res.returncode == 0, res
        return res.stdout

    assert "data        1 object, " in run("show", url)
    assert re.search(r"^OK  .*: 1 object, ", run("verify", url), re.M)
    assert "(the manifest and 1 object, 0 uploads)" in run("rm", url, "--dry-run")
