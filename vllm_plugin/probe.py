"""Start one vLLM engine with a kvtune block (or none) and report what it did, as one JSON object.

    python -m kvtune.vllm_plugin.probe --model DIR --block-size 32 --memory-bytes 67108864 \\
        --kvtune '{"kv_cache_strategy": "hybrid_v2", ...}' --prompts prompts.json --chunk 32 --out out.json

Reported: vLLM's version, the pool's block count, the impl class of the first attention layer, vLLM's
own token capacity and maximum concurrency at ``--max-model-len`` (its "KV cache size" line), and, for
each prompt (a JSON list of token-id lists), the teacher-forced log-probability of every prompt token
after the first over chunked prefill (``--chunk`` tokens per step), ``--passes`` times (with
``--prefix-caching`` the later passes hit the cache), and with ``--generate N`` N greedy tokens each.
Run it from outside the repository root: a checkout's ``kernels/`` folder would shadow Hugging Face's
``kernels`` package that transformers imports. The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the pool can be inspected.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvtune.vllm_plugin.probe", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--memory-bytes", type=int, required=True, help="vLLM's --kv-cache-memory-bytes")
    p.add_argument("--kvtune", default="", help="the kvtune block (JSON); empty: none (the plugin is inert)")
    p.add_argument("--prompts", default="", help="a JSON file: a list of token-id lists")
    p.add_argument("--chunk", type=int, default=32, help="--max-num-batched-tokens (the prefill chunk)")
    p.add_argument("--passes", type=int, default=1)
    p.add_argument("--generate", type=int, default=0, help="also decode this many tokens greedily per prompt")
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _engine(a: argparse.Namespace) -> Any:
    from vllm import LLM

    extra = {"kvtune": json.loads(a.kvtune)} if a.kvtune else {}
    return LLM(
        model=a.model,
        skip_tokenizer_init=True,
        dtype=a.dtype,
        block_size=a.block_size,
        kv_cache_memory_bytes=a.memory_bytes,
        max_num_batched_tokens=a.chunk,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        enable_chunked_prefill=True,
        enable_prefix_caching=a.prefix_caching,
        enforce_eager=True,
        additional_config=extra,
        seed=0,
    )


def _first_impl(model: Any) -> str:
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if impl is not None:
            return f"{type(impl).__module__}.{type(impl).__qualname__}"
    return ""


def _prompt_logprobs(llm: Any, prompts: list[list[int]]) -> list[list[float]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [
        [float(step[tok].logprob) for step, tok in zip(o.prompt_logprobs[1:], p[1:])]
        for o, p in zip(outs, prompts)
    ]


def _greedy(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=n, detokenize=False, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def probe(a: argparse.Namespace) -> dict[str, Any]:
    import vllm

    t0 = time.perf_counter()
    llm = _engine(a)
    start_s = time.perf_counter() - t0
    core = llm.llm_engine.engine_core.engine_core
    kv = core.scheduler.kv_cache_config
    runner = core.model_executor.driver_worker.worker.model_runner
    out: dict[str, Any] = {
        "vllm": vllm.__version__,
        "num_blocks": int(kv.num_blocks),
        "groups": [type(g.kv_cache_spec).__name__ for g in kv.kv_cache_groups],
        "block_sizes": [int(g.kv_cache_spec.block_size) for g in kv.kv_cache_groups],
        "impl": _first_impl(runner.model),
        "kv_cache_size_tokens": int(core.vllm_config.cache_config.kv_cache_size_tokens),
        "max_concurrency": round(float(core.vllm_config.cache_config.kv_cache_max_concurrency), 3),
        "start_s": round(start_s, 1),
    }
    if a.prompts:
        with open(a.prompts, encoding="utf-8") as f:
            prompts = json.load(f)
        t0 = time.perf_counter()
        out["passes"] = [_prompt_logprobs(llm, prompts) for _ in range(a.passes)]
        out["logprobs_s"] = round(time.perf_counter() - t0, 1)
        if a.generate:
            out["generated"] = _greedy(llm, prompts, a.generate)
    return out


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    a = _args(argv)
    result = probe(a)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
