"""turnout/envs.py: every variable parsed once, typed; a bad value is a ValueError naming the variable; the
docs table lists every variable; nothing else in turnout/ reads the environment."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from turnout import envs

REPO = Path(__file__).resolve().parents[1]

BAD = {
    "TURNOUT_PDL": ["maybe", "2"],
    "TURNOUT_PDL_EARLY": ["attention,o_proj", "nosuch"],
    "TURNOUT_SMALL_M_TILES": ['{"40,200": [2, 64]}', '{"40,200": [0, 64, 1, 1]}', "[1, 2]", "{40: 1",
                              '{"40": [2, 64, 1, 1]}', '{"a,b": [2, 64, 1, 1]}', '{"40,200": [2, 64, 1, true]}'],
    "TURNOUT_MOE_DECODE_CONFIG": ["not json", "[16]", '{"block_n2": "64"}', '{"block_k1": 0}', '{"one_token": 2}',
                                  '{"one_token": true}'],
    "TURNOUT_ATTN_DECODE": ['{"block_n": 48}', '{"block_n": 8}', '{"num_warps": 0}', '{"num_stages": "2"}',
                            '{"splits": 2}', "3"],
    "TURNOUT_ROPE_ATTENTION": ["off please"],
    "TURNOUT_MLA_PREFILL": ["mha", "1"],
    "TURNOUT_BENCH_CONFIGS": ["/no/such/directory/turnout"],
    "TRITON_INTERPRET": ["sometimes"],
    "RANK": ["-1", "one"],
    "RAY_LOCAL_WORLD_SIZE": ["0", "2.5"],
}


def test_defaults():
    e = envs.load({})
    assert e == envs.Envs()
    assert (e.ops, e.pdl, e.pdl_early, dict(e.small_m_tiles), e.rope_attention, e.api_key, e.triton_interpret) == (
        None, True, None, {}, True, None, False)


def test_typed_values(tmp_path):
    e = envs.load({
        "TURNOUT_OPS": " rms_norm=reference.torch ", "TURNOUT_PDL": "0", "TURNOUT_PDL_EARLY": "linear, attention",
        "TURNOUT_SMALL_M_TILES": '{"2048,4096": [8, 1024, 4, 4]}',
        "TURNOUT_MOE_DECODE_CONFIG": '{"block_n2": 16, "num_stages2": null, "one_token": 0}',
        "TURNOUT_ATTN_DECODE": '{"num_splits": 1, "block_n": 128}', "TURNOUT_ROPE_ATTENTION": "false",
        "TURNOUT_MLA_PREFILL": " Decompressed ", "TURNOUT_API_KEY": "sk-1", "TURNOUT_BENCH_CONFIGS": str(tmp_path), "TRITON_INTERPRET": "1"})
    assert e.ops == "rms_norm=reference.torch" and e.pdl is False and e.pdl_early == {"linear", "attention"}
    assert dict(e.small_m_tiles) == {(2048, 4096): (8, 1024, 4, 4)}
    assert dict(e.moe_decode_config) == {"block_n2": 16, "num_stages2": None, "one_token": 0}
    assert dict(e.attn_decode) == {"num_splits": 1, "block_n": 128}
    assert e.rope_attention is False and e.api_key == "sk-1" and e.bench_configs == tmp_path
    assert e.triton_interpret is True and e.mla_prefill == "decompressed"
    # an empty value is unset, except TURNOUT_PDL_EARLY, where empty means "no kernel" (unset: the default)
    blank = envs.load({name: "" for name in envs.VARIABLES})
    assert blank == envs.Envs(pdl_early=frozenset())
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.pdl = True


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in BAD.items() for v in vs])
def test_a_bad_value_is_an_error_naming_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        envs.load({name: value})


def test_every_variable_has_a_bad_value_case_or_takes_any_text():
    # TURNOUT_OPS is parsed by the policy (below); the native build's paths and compiler are any text (made or run
    # on first use, a failure named then)
    free_text = {"TURNOUT_OPS", "TURNOUT_API_KEY", "TURNOUT_NATIVE_CACHE", "CXX", "XDG_CACHE_HOME"}
    assert set(BAD) | free_text == set(envs.VARIABLES)


def test_bad_turnout_ops_names_the_variable():
    from turnout.ops import Policy, PolicyError

    with pytest.raises(PolicyError, match="TURNOUT_OPS"):
        Policy.from_sources(env={"TURNOUT_OPS": "prefer=gpu"})


def test_read_once_and_reload(monkeypatch):
    before = envs.get()
    assert envs.get() is before and envs.load() is before
    monkeypatch.setenv("TURNOUT_ROPE_ATTENTION", "0" if before.rope_attention else "1")
    assert envs.get() is before  # not re-read by itself
    assert envs.reload().rope_attention is not before.rope_attention
    assert envs.get().rope_attention is not before.rope_attention


def test_the_cli_reports_a_bad_variable_in_one_line():
    env = {"PATH": "/usr/bin:/bin", "TURNOUT_ATTN_DECODE": '{"num_warps": 0}'}
    p = subprocess.run([sys.executable, "-m", "turnout.entrypoints.cli", "ops"], capture_output=True, text=True,
                       env=env, timeout=120, cwd=REPO)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["turnout: error: TURNOUT_ATTN_DECODE: num_warps must be a positive "
                                             "integer, got 0"]


def test_docs_table_lists_every_variable():
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([A-Z_]+)` \|", section, re.M))
    assert listed == set(envs.VARIABLES)


def test_nothing_else_in_turnout_reads_the_environment():
    pattern = re.compile(r"os\.environ|getenv\(")
    offenders = [f"{p.relative_to(REPO)}:{n}" for p in (REPO / "turnout").rglob("*.py") if p.name != "envs.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
