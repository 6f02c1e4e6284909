"""EngineConfig's fields are the one list of engine options: LLM(**options) and the flags of `turnout serve /
generate / bench` are made from them. Every field is reachable from both (a new field without a flag fails
here), a mistyped option names the closest one, and vLLM's flags that change nothing here are accepted."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from turnout.config import FIELDS, VLLM_NOOPS, EngineConfig
from turnout.entrypoints import bench_cmd, cli, generate_cmd
from turnout.entrypoints.engine_args import cli_fields
from turnout.entrypoints.openai import serve_cmd

# A value other than the default for every field, with what else it needs to be valid. Adding a field to
# EngineConfig without adding it here fails test_every_field_has_a_test_value.
OTHER = {
    "model": ("m.gguf", {}), "dtype": ("float16", {}), "device": ("cpu", {}), "max_model_len": (77, {}),
    "max_num_seqs": (5, {}), "max_num_batched_tokens": (96, {}), "block_size": (32, {}),
    "kv_cache_memory": (1 << 20, {}), "gpu_memory_utilization": (0.5, {}), "enable_prefix_caching": (False, {}),
    "load_format": ("dummy", {}), "seed": (7, {}), "ops_policy": ("rms_norm=reference", {}),
    "batch_invariant": (True, {}), "enforce_eager": (True, {}), "num_speculative_tokens": (2, {}),
    "async_scheduling": (True, {}),
    "tokenizer": ("tok", {}), "served_model_name": ("name", {}), "max_tokens_per_request": (900, {}),
    "fair_share_seqs": (3, {}), "tensor_parallel_size": (2, {}), "distributed_executor_backend": ("mp", {}),
    "nnodes": (2, {"tensor_parallel_size": 2}), "node_rank": (1, {"nnodes": 2, "tensor_parallel_size": 2}),
    "master_addr": ("10.0.0.1", {}), "master_port": (29600, {}), "ray_address": ("auto", {}),
    "distributed_timeout_s": (12.5, {}), "data_parallel_size": (2, {}),
    "data_parallel_rank": (1, {"data_parallel_size": 2}), "enable_expert_parallel": (True, {}),
    "preemption_mode": ("swap", {}), "swap_space": (1.5, {}), "kv_offload_gb": (2.0, {}),
    "quantization": ("fp8", {}), "kv_cache_dtype": ("fp8", {}),
    "model_impl": ("transformers", {}), "num_hidden_layers": (2, {}),
    "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 2}', {}),
}


def _serve_args(*argv):
    return cli.build_parser().parse_args(["serve", *argv])


def _flags(options: dict) -> list[str]:
    """``options`` as serve's command line (the flags made from the fields' metadata)."""
    by_name = {f.name: f for f in dataclasses.fields(EngineConfig)}
    argv = []
    for name, value in options.items():
        if name == "model":
            argv.append(value)
            continue
        flag = by_name[name].metadata.get("flag") or "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


@pytest.fixture
def llm_config(monkeypatch):
    """LLM(**options) -> the EngineConfig it would start its engine with (the engine itself is not started)."""
    from turnout.engine import llm

    monkeypatch.setattr(llm, "LLMEngine", lambda config: config)
    return lambda *a, **kw: llm.LLM(*a, **kw).config


def test_every_field_has_a_test_value():
    assert set(OTHER) == set(FIELDS)
    for name, (value, _) in OTHER.items():
        assert value != EngineConfig.__dataclass_fields__[name].default, name


def test_every_field_has_help():
    for f in dataclasses.fields(EngineConfig):
        assert len(f.metadata.get("help") or "") > 10, f.name


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_reaches_the_config_from_llm(name, llm_config):
    value, needs = OTHER[name]
    config = llm_config(**{name: value, **needs})
    assert getattr(config, name) == value
    assert config == EngineConfig(**{name: value, **needs})


@pytest.mark.parametrize("name", [f.name for f in cli_fields()])
def test_every_field_reaches_the_config_from_serve_flags(name):
    value, needs = OTHER[name]
    config = serve_cmd.build_config(_serve_args(*_flags({**needs, name: value})))
    assert config == EngineConfig(**{name: value, **needs})


def test_only_fields_turnout_sets_itself_have_no_flag():
    assert {f.name for f in dataclasses.fields(EngineConfig) if not f.metadata.get("cli", True)} == {"data_parallel_rank", "num_hidden_layers"}


def test_flag_defaults_are_the_fields_defaults():
    assert serve_cmd.build_config(_serve_args()) == EngineConfig()
    generate = cli.build_parser().parse_args(["generate", "hi"])
    bench = cli.build_parser().parse_args(["bench", "latency"])
    for excluded, args, differ in ((generate_cmd.EXCLUDED, generate, {}),
                                   (bench_cmd.BENCH_EXCLUDED, bench,
                                    {"enable_prefix_caching": False, "max_num_batched_tokens": None})):
        for f in cli_fields(excluded):
            assert getattr(args, f.name) == differ.get(f.name, f.default), f.name


def test_quantization_choices_are_the_methods():
    from turnout.quant.config import METHODS

    assert tuple(EngineConfig.__dataclass_fields__["quantization"].metadata["choices"]) == METHODS


def test_llm_unknown_option_names_the_closest_field(llm_config):
    with pytest.raises(ValueError, match=r"^unknown option 'tensor_paralel_size'; did you mean "
                                         r"'tensor_parallel_size'\?$"):
        llm_config(tensor_paralel_size=2)
    with pytest.raises(ValueError, match=r"^unknown option 'zzz'$"):
        llm_config(zzz=1)


@pytest.mark.parametrize("argv,wrong,right", [
    (["serve", "--tensor-paralel-size", "2"], "--tensor-paralel-size", "--tensor-parallel-size"),
    (["generate", "hi", "--max-num-batched-tokns", "8"], "--max-num-batched-tokns", "--max-num-batched-tokens"),
    (["bench", "latency", "--enforce-eagr"], "--enforce-eagr", "--enforce-eager"),
    (["bench", "throughput", "--num-promptz=3"], "--num-promptz", "--num-prompts"),
])
def test_command_unknown_option_names_the_closest_flag(argv, wrong, right, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown option '{wrong}'; did you mean '{right}'?" in err, err


def test_vllm_noop_flags_are_accepted_with_a_note(caplog):
    argv = ["--disable-log-requests", "--disable-log-stats", "--enable-chunked-prefill", "--generation-config",
            "vllm", "--disable-uvicorn-access-log", "--disable-frontend-multiprocessing"]
    assert {a[2:].replace("-", "_") for a in argv if a.startswith("--")} == set(VLLM_NOOPS)
    with caplog.at_level(logging.INFO, logger="turnout.config"):
        assert serve_cmd.build_config(_serve_args(*argv)) == EngineConfig()
    notes = [r.getMessage() for r in caplog.records if r.name == "turnout.config"]
    assert len(notes) == len(VLLM_NOOPS) and all("no effect" in n for n in notes), notes
    assert serve_cmd.build_config(_serve_args("--generation-config", "auto")) == EngineConfig()
    generate = cli.build_parser().parse_args(["generate", "hi", "--enable-chunked-prefill"])
    assert generate.enable_chunked_prefill is True  # generate and bench take those of vLLM's engine too
    with pytest.raises(SystemExit):  # but not the server's
        cli.build_parser().parse_args(["generate", "hi", "--disable-uvicorn-access-log"])


def test_vllm_noop_values_that_ask_for_something_are_refused(llm_config, tmp_path):
    with pytest.raises(ValueError, match="^--enable-chunked-prefill: False is not supported: turnout has no "
                                         "unchunked prefill"):
        serve_cmd.build_config(_serve_args("--no-enable-chunked-prefill"))
    with pytest.raises(ValueError, match="^--generation-config: .* not applied by turnout"):
        serve_cmd.build_config(_serve_args("--generation-config", str(tmp_path)))
    with pytest.raises(SystemExit):  # a flag takes no value
        cli.build_parser().parse_args(["serve", "--disable-log-stats=1"])
    assert llm_config(enable_chunked_prefill=True, disable_log_stats=True, generation_config="auto") == EngineConfig()
    with pytest.raises(ValueError, match="^generation_config: "):
        llm_config(generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="^unknown option 'disable_log_requests'"):  # a server flag, in vLLM too
        llm_config(disable_log_requests=True)
