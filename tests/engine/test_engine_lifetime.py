"""A dropped engine frees its memory at once: nothing it owns points back at it (a cycle would keep the
weights and the KV cache alive until the cyclic collector runs; on a GPU, the next engine then finds no
memory for its KV cache)."""

import gc
import weakref

from turnout import LLM, SamplingParams


def test_a_dropped_engine_is_freed_without_the_cycle_collector():
    llm = LLM(max_num_seqs=2, kv_cache_memory=1 << 22)
    llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    runner = llm.engine.runner
    refs = {"engine": weakref.ref(llm.engine), "runner": weakref.ref(runner), "model": weakref.ref(runner.model),
            "kv cache": weakref.ref(runner.kv_caches[0][0])}
    del runner
    gc.collect()
    gc.disable()
    try:
        del llm
        assert [name for name, ref in refs.items() if ref() is not None] == []
    finally:
        gc.enable()
