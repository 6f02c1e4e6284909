"""How `turnout generate` and `LLM` take the model: a model file or directory given first is the model, not a
prompt; a path that does not exist is one error line naming it, before anything is loaded (no platform probe,
no op table, no weights)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from turnout import LLM  # noqa: E402


def _cli(*args, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "turnout.entrypoints.cli", "generate", "--log-level", "INFO", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


@pytest.mark.parametrize("how", [("{missing}", "hello"), ("--model", "{missing}", "hello")], ids=["first", "flag"])
def test_a_missing_model_file_is_named_before_loading(tmp_path, how):
    missing = str(tmp_path / "nowhere" / "model.gguf")
    r = _cli(*[a.format(missing=missing) for a in how])
    assert r.returncode == 2, r.stderr
    assert missing in r.stderr and "does not exist" in r.stderr, r.stderr
    assert "op dispatch" not in r.stderr and "loading" not in r.stderr, r.stderr  # nothing started
    assert "Traceback" not in r.stderr


def test_the_python_api_names_a_missing_path_at_once(tmp_path):
    missing = str(tmp_path / "no_such_dir")
    with pytest.raises(ValueError, match="no_such_dir.*does not exist"):
        LLM(missing, device="cpu")


def test_a_model_file_given_first_is_the_model():
    from turnout.loader import default_model_path

    try:
        gguf = default_model_path()
    except ValueError as e:
        pytest.skip(str(e))
    r = _cli(gguf, "The capital of France is", "--max-tokens", "2", "--device", "cpu")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"loading {gguf}" in r.stderr, r.stderr[-3000:]
    alone = _cli(gguf)  # a model and no prompt: said, not generated from the path's text
    assert alone.returncode == 2 and "no prompt follows" in alone.stderr, alone.stderr


def test_text_that_is_not_a_model_stays_a_prompt(tmp_path):
    from argparse import Namespace

    from turnout.entrypoints.generate_cmd import _model_given_as_prompt

    (tmp_path / "notes").mkdir()  # a directory without config.json is not a model
    for prompts in (["2+2="], [str(tmp_path / "notes"), "x"], ["What is model.gguf?"], ["a/b"]):
        args = Namespace(model=None, prompts=list(prompts))
        _model_given_as_prompt(args)
        assert args.model is None and args.prompts == prompts
    (tmp_path / "model").mkdir()  # an HF directory is
    (tmp_path / "model" / "config.json").write_text("{}")
    args = Namespace(model=None, prompts=[str(tmp_path / "model"), "hi"])
    _model_given_as_prompt(args)
    assert args.model == str(tmp_path / "model") and args.prompts == ["hi"]
