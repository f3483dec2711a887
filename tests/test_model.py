"""The Llama decoder against Hugging Face transformers: HF directories, the SmolLM2 GGUF, random shapes.

Cache paths (prefill with a prefix hit, then batched decode) run against a dense test double and against the
real hybrid cache with ``quantization_bits=0``; both must reproduce transformers' logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvtune.engine.engine import prompt_rows
from kvtune.engine.model import LlamaModel, LoadedModel, export_hf_dir, load_model, rope_inv_freq
from kvtune.engine.traces import Request
from kvtune.engine.weights import SHAPES, smollm2_gguf_path, unpermute_rope_rows

transformers = pytest.importorskip("transformers")

ATOL = RTOL = 1e-4  # float32; observed differences ~2e-6 (tiny model), ~4e-5 (SmolLM2, |logits| ~ 27)
LLAMA3_ROPE = {  # transformers writes rope_theta into the dict it is given: pass copies
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
PROMPTS = (45, 61)  # prompt lengths of the two sequences; the second shares the first 33 tokens of the first
SHARED = 33
DECODE_STEPS = 12


def _hf_model(tie: bool, rope: dict[str, Any] | None) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, rope_theta=500.0, rope_scaling=dict(rope) if rope else None,
        tie_word_embeddings=tie,
        max_position_embeddings=256, rms_norm_eps=1e-5,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)  # larger than the usual 0.02 so attention is far from uniform
    return model


def _saved(tmp_path: Path, hf: Any) -> Path:
    hf.save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    hf = _hf_model(tie=False, rope=LLAMA3_ROPE)
    return hf, load_model(str(_saved(tmp_path_factory.mktemp("hf"), hf)))


@pytest.fixture(scope="module")
def sequences() -> list[torch.Tensor]:
    """Two token sequences (prompt + forced decode tokens) with a shared prefix."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 97, (PROMPTS[0] + DECODE_STEPS,), generator=g)
    b = torch.randint(0, 97, (PROMPTS[1] + DECODE_STEPS,), generator=g)
    b[:SHARED] = a[:SHARED]
    return [a, b]


def _hf_logits(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


# ---------------------------------------------------------------------------------------------- caches


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T,Hq,D] are the last T positions of k/v [S,H,D]; causal; -> [T,Hq,D]."""
    t, s, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    mask = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
    k, v = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


class DenseTestCache:
    """Test double of the cache interface: full-precision K/V per (layer, sequence), no prefix sharing."""

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def add_sequence(self, seq_id: int, token_ids: list[int]) -> int:
        return 0

    def _append(
        self, layer: int, seq_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        old = self.kv.get((layer, seq_id), (k[:0], v[:0]))
        self.kv[(layer, seq_id)] = (torch.cat([old[0], k]), torch.cat([old[1], v]))
        return self.kv[(layer, seq_id)]

    def prefill(
        self, layer: int, seq_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return _dense_attention(q, *self._append(layer, seq_id, k, v))

    def begin_step(self, seq_ids: list[int], now_ms: float) -> list[int]:
        return list(seq_ids)

    def decode(
        self, layer: int, plan: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        rows = [self._append(layer, s, k[b : b + 1], v[b : b + 1]) for b, s in enumerate(plan)]
        return torch.cat([_dense_attention(q[b : b + 1], *kv) for b, kv in enumerate(rows)])

    def end_step(self, plan: list[int]) -> None:
        return None


def _make_cache(kind: str, model: LlamaModel) -> Any:
    if kind == "dense":
        return DenseTestCache()
    hybrid = pytest.importorskip("kvtune.cache_impl.hybrid_cache", reason="the hybrid cache is not built yet")
    from kvtune.cache_impl.config import HybridConfig

    config = HybridConfig(kv_cache_strategy="hybrid_v2", hot_tokens=16, block_size=8, quantization_bits=0)
    return hybrid.HybridCache(config, model.kv_shape, budget_bytes=1 << 22, device="cpu")


def _run_through_cache(cache: Any, model: LlamaModel, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Prefill each prompt (after its prefix hit), decode the forced tokens in one batch; logits per seq."""
    out: list[list[torch.Tensor]] = []
    for sid, ids in enumerate(seqs):
        prompt = ids[: PROMPTS[sid]]
        hit = cache.add_sequence(sid, prompt.tolist())
        out.append([model.prefill(cache, sid, prompt[hit:], hit)])
    for step in range(DECODE_STEPS - 1):
        plan = cache.begin_step([0, 1], now_ms=float(step))
        positions = torch.tensor([PROMPTS[0] + step, PROMPTS[1] + step])
        logits = model.decode(cache, plan, torch.stack([s[p] for s, p in zip(seqs, positions)]), positions)
        cache.end_step(plan)
        out[0].append(logits[:1])
        out[1].append(logits[1:])
    return [torch.cat(parts) for parts in out]


# ---------------------------------------------------------------------------------------------- HF directory


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["rope", "llama3-rope"])
def test_forward_dense_matches_transformers(tmp_path: Path, tie: bool, rope: dict[str, Any] | None) -> None:
    hf = _hf_model(tie, rope)
    loaded = load_model(str(_saved(tmp_path, hf)))
    ids = torch.arange(40) * 7 % 97
    assert (loaded.real_weights, loaded.spec.tie_embeddings, loaded.spec.num_heads) == (True, tie, 6)
    torch.testing.assert_close(loaded.model.forward_dense(ids), _hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_cache_paths_match_transformers(
    pair: tuple[Any, LoadedModel], sequences: list[torch.Tensor], kind: str
) -> None:
    hf, loaded = pair
    cache = _make_cache(kind, loaded.model)
    got = _run_through_cache(cache, loaded.model, sequences)
    want = [_hf_logits(hf, s[:-1]) for s in sequences]
    hits = [len(s) - 1 - len(g) for s, g in zip(sequences, got)]
    assert hits == [0, 0] if kind == "dense" else hits[1] > 0  # the hybrid cache reuses sealed prefix blocks
    torch.testing.assert_close(got[0], want[0][hits[0] :], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[1], want[1][hits[1] :], atol=ATOL, rtol=RTOL)


def test_prefill_last_only_is_the_last_row(
    pair: tuple[Any, LoadedModel], sequences: list[torch.Tensor]
) -> None:
    _, loaded = pair
    full = loaded.model.prefill(DenseTestCache(), 0, sequences[0], 0)
    last = loaded.model.prefill(DenseTestCache(), 0, sequences[0], 0, last_only=True)
    torch.testing.assert_close(last, full[-1:])


@pytest.mark.parametrize("shard_mb", [0, 0.02], ids=["one-file", "shards"])
def test_export_round_trips(pair: tuple[Any, LoadedModel], tmp_path: Path, shard_mb: float) -> None:
    hf, _ = pair
    out = export_hf_dir(str(_saved(tmp_path / "in", hf)), tmp_path / "out", torch.float32, shard_mb)
    back = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.arange(30) * 5 % 97
    assert (len(list(out.glob("*.safetensors"))) > 1) == (shard_mb > 0)
    torch.testing.assert_close(
        load_model(str(out)).model.forward_dense(ids), _hf_logits(hf, ids), atol=ATOL, rtol=RTOL
    )
    torch.testing.assert_close(_hf_logits(back.eval(), ids), _hf_logits(hf, ids), atol=0, rtol=0)


def _break(case: str, d: Path) -> None:
    if case == "no-config":
        (d / "config.json").unlink()
    elif case == "no-safetensors":
        (d / "model.safetensors").unlink()
    elif case == "bad-json":
        (d / "config.json").write_text("{oops")
    else:
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(config | {"intermediate_size": 81}))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no-config", "config.json: missing"),
        ("no-safetensors", "no *.safetensors"),
        ("bad-json", "config.json: unreadable as JSON"),
        ("wrong-shape", "has shape [80, 48], expected [81, 48]"),
    ],
)
def test_bad_model_directory_gives_one_line(
    pair: tuple[Any, LoadedModel], tmp_path: Path, case: str, expected: str
) -> None:
    hf, _ = pair
    d = _saved(tmp_path / "m", hf)
    _break(case, d)
    with pytest.raises(ValueError, match=str(tmp_path)) as info:
        load_model(str(d))
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("no/such/dir", "not found"), ("random:llama-9", "unknown shape 'llama-9'"), ("smollm3", "random:tiny")],
)
def test_unknown_model_name(name: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        load_model(name)


# ---------------------------------------------------------------------------------------------- random shapes


@pytest.mark.parametrize(
    ("shape", "params", "context"),
    [
        ("llama-3-8b", 8_030_261_248, 8192),
        ("llama-3.1-8b", 8_030_261_248, 131072),
        ("smollm2-135m", 134_515_008, 8192),
        ("tiny", 151_872, 4096),
    ],
)
def test_named_shapes(shape: str, params: int, context: int) -> None:
    assert (SHAPES[shape].num_params, SHAPES[shape].max_context) == (params, context)


def test_llama31_rope_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=5e5,
        max_position_embeddings=131072,
        rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 8192, "rope_theta": 5e5},
    )  # fmt: skip
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(SHAPES["llama-3.1-8b"]), want.float())


@pytest.mark.parametrize("seed", [0, 1])
def test_random_tiny_is_seeded(seed: int) -> None:
    a, b = load_model("random:tiny", seed=seed), load_model("random:tiny", seed=seed)
    ids = torch.arange(9)
    assert (a.real_weights, a.tokenizer) == (False, None)
    torch.testing.assert_close(a.model.forward_dense(ids), b.model.forward_dense(ids), rtol=0, atol=0)
    assert not torch.equal(a.model.embed, load_model("random:tiny", seed=seed + 2).model.embed)


def test_warm_rows_runs_each_new_row_count_once_and_changes_nothing() -> None:
    loaded = load_model("random:tiny", seed=3)
    ids = torch.arange(9)
    before = loaded.model.forward_dense(ids)
    assert loaded.model.warm_rows([5, 1, 5, 0, 12]) == 3
    assert loaded.model.rows_warmed == {1, 5, 12} and not loaded.model.logits_warmed
    assert loaded.model.warm_rows([12, 1]) == 0 and loaded.model.warm_rows([2]) == 1
    assert loaded.model.warm_rows([2], logits=[3, 1]) == 2 and loaded.model.logits_warmed == {1, 3}
    torch.testing.assert_close(loaded.model.forward_dense(ids), before, rtol=0, atol=0)


def test_prompt_rows_are_the_chunks_of_prompts_alone() -> None:
    requests = [Request(i, 0.0, n, 4) for i, n in enumerate([7, 16, 40, 33, 7])]
    assert prompt_rows(requests, 16) == {7, 16, 8, 1}


def test_kv_shape() -> None:
    shape = load_model("random:tiny").model.kv_shape
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.num_q_heads) == (2, 2, 16, 4)
    assert shape.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- GGUF


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q_proj/k_proj rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize(("rows", "cols", "n_head"), [(576, 576, 9), (192, 576, 3), (8, 3, 2), (4, 1, 1)])
def test_unpermute_inverts_llama_cpp(rows: int, cols: int, n_head: int) -> None:
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_head)
    assert (rows <= 4 or not np.array_equal(permuted, w)) and np.array_equal(
        unpermute_rope_rows(permuted, n_head), w
    )


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


def test_smollm2_gguf_knows_paris(smollm2: LoadedModel) -> None:
    assert smollm2.tokenizer is not None
    ids = smollm2.tokenizer.encode("The capital of France is")
    logits = smollm2.model.forward_dense(torch.tensor(ids))
    assert ids == [504, 3575, 282, 4649, 314]
    assert smollm2.tokenizer.decode([int(logits[-1].argmax())]) == " Paris"
    assert (smollm2.spec.num_layers, smollm2.spec.num_kv_heads, smollm2.spec.tie_embeddings) == (30, 3, True)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2: LoadedModel) -> None:
    path = smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Hello 12345 world!\n\n  indented\tcode = x**2 # ünïcödé 日本語 <|im_start|>user"
    ids = smollm2.tokenizer.encode(text)  # type: ignore[union-attr]
    assert ids == tok(text, add_special_tokens=False).input_ids
    torch.testing.assert_close(
        smollm2.model.forward_dense(torch.tensor(ids)),
        _hf_logits(hf.eval(), torch.tensor(ids)),
        atol=ATOL,
        rtol=RTOL,
    )
