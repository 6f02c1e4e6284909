"""What the transformers backend refuses, and how `model_impl` and `turnout models` say which implementation runs:
each refusal is a ValueError naming the architecture (or the field) and why, before any weight is read."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from turnout.config import EngineConfig
from turnout.loader import load_model
from turnout.models.registry import resolve_model_class
from turnout.models.transformers_backend.tiny import save_tiny, tiny_config
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform


@pytest.fixture(scope="module")
def ops():
    return resolve(detect_platform("cpu"))


def _truncated_checkpoint(path, model_type: str, **extra):
    """config.json of ``model_type`` and a safetensors file cut short: reading any weight would fail loudly."""
    from turnout.models.transformers_backend.support import causal_lm_class

    cfg = tiny_config(model_type, **extra)
    cfg.architectures = [causal_lm_class(cfg).__name__]
    cfg.save_pretrained(str(path))
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")


def test_attention_not_through_the_interface_is_refused_before_any_weight(tmp_path, ops):
    _truncated_checkpoint(tmp_path, "bloom")
    with pytest.raises(ValueError, match=r"BloomForCausalLM.*attention does not go through transformers' attention "
                                         r"interface"):
        load_model(str(tmp_path), ops=ops, device="cpu")


def test_recurrent_layers_are_refused(ops):
    cfg = tiny_config("granitemoehybrid")
    with pytest.raises(ValueError, match=r"GraniteMoeHybridForCausalLM.*layer_types.*mix tokens outside the attention"):
        resolve_model_class(cfg, "auto")


@pytest.mark.parametrize("model_type,why", [("bert", "bidirectional"), ("doge", "mask the model computes itself"),
                                            ("nemotron", "do not pass the model's keyword arguments down")])
def test_probe_refusals_name_the_reason(model_type, why, ops):
    """Refused by the build's probe forward (what the class does not declare), before the weights are drawn."""
    from turnout.models.transformers_backend.support import causal_lm_class

    cfg = tiny_config(model_type)
    cfg.architectures = [causal_lm_class(cfg).__name__]
    with pytest.raises(ValueError, match=rf"{cfg.architectures[0]}: cannot run through transformers' modeling code: "
                                         rf".*{why}"):
        load_model(cfg, load_format="dummy", ops=ops, device="cpu")


def test_remote_code_is_refused_with_the_reason(tmp_path, ops):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "fancy_new", "architectures": ["FancyNewForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_fancy.FancyConfig",
                     "AutoModelForCausalLM": "modeling_fancy.FancyNewForCausalLM"}}))
    with pytest.raises(ValueError, match=r"needs the model repository's own code.*trust_remote_code stays refused"):
        load_model(str(tmp_path), ops=ops, device="cpu")


def test_model_impl_native_without_a_native_class_names_the_field(ops):
    with pytest.raises(ValueError, match=r"model_impl='native': turnout has no native class for \['GPTNeoXForCausalLM'\]"):
        resolve_model_class(tiny_config("gpt_neox", architectures=["GPTNeoXForCausalLM"]), "native")
    with pytest.raises(ValueError, match=r"^model_impl: unknown implementation 'vllm'"):
        EngineConfig(model_impl="vllm")


def test_resolution_picks_native_then_transformers():
    assert resolve_model_class(tiny_config("llama", architectures=["LlamaForCausalLM"]), "auto").__name__ == \
        "LlamaForCausalLM"
    assert resolve_model_class(tiny_config("llama", architectures=["LlamaForCausalLM"]), "transformers").__name__ == \
        "TransformersForCausalLM"
    assert resolve_model_class(tiny_config("gpt_neox", architectures=["GPTNeoXForCausalLM"]), "auto").__name__ == \
        "TransformersForCausalLM"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "turnout.entrypoints.cli", "--log-level", "ERROR", "models", *args],
                          capture_output=True, text=True, timeout=300)


def test_turnout_models_lists_every_architecture_and_says_what_a_model_uses(tmp_path):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from turnout.entrypoints.models_cmd import architecture_table

    rows = architecture_table()  # what `turnout models --json` prints
    assert len(rows) >= len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    by_arch = {r["architecture"]: r for r in rows}
    assert by_arch["LlamaForCausalLM"]["status"] == "native"
    assert by_arch["GPTNeoXForCausalLM"]["status"] == "transformers"
    assert by_arch["BloomForCausalLM"]["status"] == "refused" and "attention interface" in by_arch[
        "BloomForCausalLM"]["reason"]
    save_tiny("gpt_neox", tmp_path)
    one = _cli(str(tmp_path), "--json")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["implementation"] == "transformers"
    native = _cli(str(tmp_path), "--model-impl", "native")
    assert native.returncode == 1 and "no native class" in native.stdout
