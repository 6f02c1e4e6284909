"""turnout's FlagGems plugin (plugins/turnout-flaggems) through the dispatch layer, on a CPU machine.

- FlagGems' import error is kept: its first import raises on a machine without a device and a second one in the
  same process raises something else; every implementation reports the first.
- A FlagGems kernel that raises on its first call (simulated) is replaced for that op only, the log names it
  once, and the request completes with the tokens of the default kernels.
- With the real ``flag-gems`` wheel (installed by .ci/run's FlagGems block into .venv/flaggems, or where
  TURNOUT_TEST_FLAGGEMS_SITE points) and the plugin installed by pip with --no-deps: ``turnout ops`` lists every
  implementation unavailable with FlagGems' own import error, and an engine told to prefer FlagGems starts on
  the next implementations and generates what the default engine generates.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from turnout.ops import build_registry, registry

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "plugins" / "turnout-flaggems"
sys.path.insert(0, str(PLUGIN))
from turnout_flaggems import OPS, library, prefer_policy, register  # noqa: E402

from flaggems_standins import StandIns  # noqa: E402

transformers = pytest.importorskip("transformers")
from turnout import LLM, SamplingParams  # noqa: E402

SITE = Path(os.environ.get("TURNOUT_TEST_FLAGGEMS_SITE") or ROOT / ".venv" / "flaggems")
NO_DEVICE = "import flag_gems failed: RuntimeError: No device were detected on your machine"

# A package that fails the way flag_gems 5.0.2 does without a device: the first import raises while a
# submodule it already imported stays in sys.modules; the second import then fails on the half-built state.
FAKE_FLAG_GEMS = '''
import sys, types
if "flag_gems.runtime" in sys.modules:
    raise AttributeError("'DeviceDetector' object has no attribute 'vendor_name'")
sys.modules["flag_gems.runtime"] = types.ModuleType("flag_gems.runtime")
raise RuntimeError("No device were detected on your machine ! \\n Please check that your driver is complete. ")
'''


@pytest.fixture
def fresh_library(monkeypatch):
    monkeypatch.setattr(library, "_outcome", {})
    yield
    for name in [n for n in sys.modules if n == "flag_gems" or n.startswith("flag_gems.")]:
        del sys.modules[name]


def test_the_first_import_error_is_every_implementations_reason(fresh_library, tmp_path, monkeypatch):
    (tmp_path / "flag_gems").mkdir()
    (tmp_path / "flag_gems" / "__init__.py").write_text(FAKE_FLAG_GEMS)
    monkeypatch.syspath_prepend(str(tmp_path))
    reasons = set()
    for op in OPS:
        with pytest.raises(Exception) as e:
            getattr(__import__("turnout_flaggems.loaders", fromlist=[op]), op)()
        reasons.add(str(e.value))
    assert reasons == {f"{NO_DEVICE} ! Please check that your driver is complete."}
    with pytest.raises(AttributeError, match="vendor_name"):  # what a plain second import would have said
        __import__("flag_gems")


def _tiny_llama(path: Path) -> str:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


PROMPTS = [[1, 5, 9, 14, 2], [7, 3, 3, 40, 41, 42, 8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
KW = dict(kv_cache_memory=4 << 20, dtype="float32")


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


class FailsOnce(StandIns):
    """FlagGems whose fused_add_rms_norm kernel writes part of its output, then raises on its first call (a
    Triton compile error on a new device, say)."""

    def fused_add_rms_norm(self, x, residual, normalized_shape, weight, eps=1e-5):
        self._count("fused_add_rms_norm")
        x[:1].fill_(float("nan"))
        raise RuntimeError("triton compile failed: simulated")


def test_a_kernel_failing_on_first_use_is_replaced_for_that_op_only(tiny, monkeypatch, caplog):
    default = _tokens(LLM(tiny, **KW))
    gems = FailsOnce()
    monkeypatch.setattr(library, "_outcome", {"module": gems})
    monkeypatch.setattr(library, "_declined", set())  # said once per process: earlier tests may have said it
    reg = build_registry(plugins=False)
    reg.run_registration("plugin:flaggems", register)
    monkeypatch.setattr(registry, "_default", reg)
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        llm = LLM(tiny, ops_policy=prefer_policy(), **KW)
        got = _tokens(llm)
    assert got == default
    failed = [r.getMessage() for r in caplog.records if "failed on first use" in r.getMessage()]
    assert len(failed) == 1 and "fused_add_rms_norm" in failed[0] and "vendor.flaggems" in failed[0]
    assert "simulated" in failed[0] and "falling back to vendor.cpu" in failed[0]
    assert gems.calls["fused_add_rms_norm"] == 1  # never again
    for name in ("rms_norm", "silu_and_mul_out", "apply_rotary_pos_emb", "reshape_and_cache_flash"):
        assert gems.calls.get(name, 0) > 0, name  # the other ops stayed on FlagGems
    # float32 attention is not FlagGems' case: the wrapper sent it on, and said so once
    declined = [r.getMessage() for r in caplog.records if "float32 queries" in r.getMessage()]
    assert len(declined) == 1 and "flash_attn_varlen_func" not in gems.calls


# ---- the real flag-gems wheel ------------------------------------------------------------------------------

needs_wheel = pytest.mark.skipif(not (SITE / "flag_gems").is_dir(),
                                 reason=f"flag-gems is not installed in {SITE} (.ci/run's FlagGems block)")


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "turnout-flaggems"
    shutil.copytree(PLUGIN, src)  # build in a copy: nothing is written into the checkout
    target = tmp_path_factory.mktemp("site")
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--quiet", "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert list(target.glob("turnout_flaggems-*.dist-info/entry_points.txt"))
    return target


def _env(plugin_site, **extra):
    env = {k: v for k, v in os.environ.items() if k != "TURNOUT_OPS"}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_site), str(SITE), str(ROOT)])
    env.update(extra)
    return env


@needs_wheel
def test_turnout_ops_lists_each_implementation_with_flaggems_import_error(plugin_site):
    p = subprocess.run([sys.executable, "-m", "turnout.entrypoints.cli", "ops", "--json", "--op", ",".join(OPS)],
                       capture_output=True, text=True, env=_env(plugin_site), timeout=600)
    assert p.returncode == 0, p.stderr
    rows = {r["op"]: r for r in json.loads(p.stdout)}
    assert set(rows) == set(OPS)
    for op, row in rows.items():
        cand = next(c for c in row["candidates"] if c["impl"] == "vendor.flaggems")
        assert cand["source"] == "plugin:flaggems" and not cand["available"], op
        assert cand["reason"].startswith(NO_DEVICE), (op, cand["reason"])
        assert row["chosen"] and row["chosen"] != "vendor.flaggems"


SCRIPT = """
import json, sys, logging
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from turnout import LLM, SamplingParams
from turnout_flaggems import prefer_policy
llm = LLM(sys.argv[1], ops_policy=prefer_policy(), kv_cache_memory=4 << 20, dtype="float32")
out = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in out]))
"""


@needs_wheel
def test_preferring_flaggems_without_a_device_starts_on_the_next_and_generates(plugin_site, tiny):
    p = subprocess.run([sys.executable, "-c", SCRIPT, tiny, json.dumps(PROMPTS)], capture_output=True, text=True,
                       env=_env(plugin_site), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == _tokens(LLM(tiny, **KW))
    line = next(x for x in p.stderr.splitlines() if "op dispatch on cpu" in x)
    assert f"past vendor.flaggems ({NO_DEVICE}" in line
    for op in OPS:
        assert op in line.split("past vendor.flaggems")[0], op
