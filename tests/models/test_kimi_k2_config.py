"""Kimi-K2's checkpoints: config.json with ``model_type: "kimi_k2"``, ``auto_map`` to the repository's code,
``architectures: ["DeepseekV3ForCausalLM"]`` and DeepSeek-V3's fields (the released file's remote-code names
included: rope_scaling / rope_theta, topk_method, scoring_func, aux_loss_alpha, seq_aux, ep_size). turnout reads it
with transformers' public DeepseekV3Config (turnout/loader/remote_configs.py); a tiny Kimi-K2-shaped checkpoint
equals transformers' DeepseekV3ForCausalLM on the same weights (logits within 1e-4, greedy tokens identical). A
field that is not V3's, another architecture, and Kimi's remote-code tiktoken tokenizer are refused by name."""

from __future__ import annotations

import base64
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_mla_vs_hf import KW, build_hf, prompts  # noqa: E402
from turnout import LLM, SamplingParams  # noqa: E402
from turnout.entrypoints.openai.serve_options import refuse_remote_code  # noqa: E402
from turnout.loader import config_of, load_model  # noqa: E402
from turnout.ops import resolve  # noqa: E402
from turnout.platforms.detect import detect_platform  # noqa: E402

AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}


def kimi_config(hf_config: dict) -> dict:
    """transformers' saved V3 config rewritten as Kimi-K2 ships its config.json."""
    cfg = dict(hf_config)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    cfg.update(model_type="kimi_k2", auto_map=AUTO_MAP, architectures=["DeepseekV3ForCausalLM"],
               topk_method="noaux_tc", scoring_func="sigmoid", aux_loss_alpha=0.001, seq_aux=True, ep_size=1,
               moe_layer_freq=1, torch_dtype=cfg.pop("dtype", "float32"))
    return cfg


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_k2")
    hf = build_hf("v3")
    hf.save_pretrained(path)
    cfg = kimi_config(json.loads((path / "config.json").read_text()))
    (path / "config.json").write_text(json.dumps(cfg))
    return path, hf


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_read_with_deepseek_v3_config_and_equal_to_transformers(kimi):
    path, hf = kimi
    config = config_of(str(path))
    assert isinstance(config, transformers.DeepseekV3Config) and config.architectures == ["DeepseekV3ForCausalLM"]
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 4.0
    refuse_remote_code(str(path), trust_remote_code=False)  # the server's early check lets it through too
    model = load_model(str(path), dtype=torch.float32, device="cpu", ops=resolve(detect_platform("cpu"))).model
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    from test_mla_vs_hf import _prefill

    for ids in prompts():
        ours = _prefill(model, ids)[-1]
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0, -1]
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
    llm = LLM(str(path), **KW)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for ids, out in zip(prompts(), llm.generate(prompts(), params, use_tqdm=False)):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                               pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
        assert list(out.outputs[0].token_ids) == want


def test_a_field_that_is_not_v3s_is_refused_by_name(kimi, tmp_path):
    path, _ = kimi
    bad = _edited(path, tmp_path / "linear", linear_attn_config={"kda_layers": [1, 2]})
    with pytest.raises(ValueError, match=r"linear_attn_config.*not DeepseekV3Config's nor DeepSeek-V3's"):
        config_of(str(bad))
    other = _edited(path, tmp_path / "arch", architectures=["KimiLinearForCausalLM"])
    with pytest.raises(ValueError, match=r"architectures \['KimiLinearForCausalLM'\]"):
        config_of(str(other))


def test_kimis_remote_code_tokenizer_is_refused_clearly(kimi, tmp_path):
    """Kimi ships tiktoken.model and a tokenizer_config.json whose auto_map names tokenization_kimi's class; without
    the repository's code nothing in transformers reads it as Kimi does: refused before AutoTokenizer would ask
    to run that code."""
    path, _ = kimi
    dst = tmp_path / "with_tokenizer"
    shutil.copytree(path, dst)
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]"}))
    (dst / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                                                for i, t in enumerate([b"a", b"b", b"ab", b" "])))
    with pytest.raises(ValueError, match=r"tokenization_kimi\.TikTokenTokenizer.*tiktoken\.model.*split pattern"):
        load_model(str(dst), dtype=torch.float32, device="cpu", ops=resolve(detect_platform("cpu")))
