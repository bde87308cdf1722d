"""The stage marker fires on its token ids (an added special token such as ``</think>``) and on text."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stagereplay.engines.transformers.engine import Runtime, load_model
from stagereplay.experiments import constructions
from stagereplay.experiments.constructions import MarkerMatcher, StageBoundary, build_live
from stagereplay.experiments.job import JobContext, ShardSpec
from stagereplay.experiments.shards import run_construction_shard, run_live_shard
from stagereplay.inputs.checkpoints import write_model_record
from stagereplay.ledger.environment import ENVIRONMENT_COLUMNS
from stagereplay.ledger.tables import PROMPT_SCHEMA, TRAJECTORY_SCHEMA, read_table, write_table

PROMPT = [257, 10, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 258, 10]
MARKER = "</think>"
BUDGET = 16


def free_run(loaded, budget=BUDGET):
    return build_live(loaded, PROMPT, StageBoundary(budget), frozenset(), loaded.tokenizer)


def choose_copy(model, generated: list[int]) -> tuple[int, int, float]:
    """(step s, token v, scale c): a token whose tied embedding is c x v's scores c x v's logit, since
    logits are linear in the embedding row; c is set between v's highest share of the winning logit
    before step s and its share at s, so the copy overtakes the winner first at step s."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([PROMPT + generated])).logits[0, len(PROMPT) - 1 :].float()
    logits = logits[: len(generated)]
    best = logits.max(dim=-1).values
    assert bool((best > 0).all()), "the winning logit must be positive for a scaled copy to overtake it"
    share = logits / best[:, None]
    for step in range(4, len(generated) - 2):
        before = share[:step].max(dim=0).values.clamp(min=0)
        # Only tokens already near the winner at s, with a wide relative gap: this search uses one
        # prefill while decoding feeds token by token, so its logits differ in the last bits.
        gap = torch.where(share[step] > 0.05, (share[step] - before) / share[step], torch.tensor(-1.0))
        token = int(gap.argmax())
        if gap[token] > 0.05:
            return step, token, float(2 / (share[step, token] + before[token]))
    raise AssertionError("no token overtakes the winner at a later step when scaled — change the seed or PROMPT")


@pytest.fixture(scope="module")
def marker_folder(tiny_qwen2_folder, tmp_path_factory):
    """The tiny Qwen2 with ``</think>`` added as a special token, made to be emitted at a known step."""
    folder = tmp_path_factory.mktemp("marker") / "model"
    shutil.copytree(tiny_qwen2_folder, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    original = load_model(folder, Runtime(precision="fp32", device="cpu", threads=1))
    generated = list(free_run(original).reasoning.tokens)
    step, copied, scale = choose_copy(original.model, generated)
    tokenizer.add_special_tokens({"additional_special_tokens": [MARKER]})
    marker_id = tokenizer.convert_tokens_to_ids(MARKER)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)  # its row is set next
    with torch.no_grad():
        model.get_input_embeddings().weight[marker_id] = scale * model.get_input_embeddings().weight[copied]
    assert (
        model.config.tie_word_embeddings
        and model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, step, marker_id, generated


@pytest.fixture(scope="module")
def marker_loaded(marker_folder):
    folder, step, marker_id, generated = marker_folder
    loaded = load_model(folder, Runtime(precision="fp32", device="cpu", threads=1))
    # The premise, checked rather than hoped: the model now emits the marker token at `step`, after
    # the same tokens as before, and decoding without special tokens makes it vanish.
    tokens = list(free_run(loaded).reasoning.tokens)
    assert tokens[:step] == generated[:step] and tokens[step] == marker_id
    assert loaded.tokenizer.encode(MARKER, add_special_tokens=False) == [marker_id]
    assert MARKER not in loaded.tokenizer.decode(tokens, skip_special_tokens=True)
    return loaded, step, marker_id


def test_a_special_token_marker_ends_the_stage_on_its_token_id(marker_loaded):
    loaded, step, marker_id = marker_loaded
    live = build_live(loaded, PROMPT, StageBoundary(BUDGET, MARKER), frozenset(), loaded.tokenizer)
    assert live.reasoning.stop == "marker" and live.marker_match == "token_ids"
    assert len(live.reasoning.tokens) == step + 1 and live.prefix[-1] == marker_id
    assert live.state.num_positions == len(live.prefix) - 1


def test_a_marker_spanning_tokens_ends_the_stage_on_text(tiny_qwen2_folder, tiny_fp32):
    generated = list(free_run(tiny_fp32).reasoning.tokens)
    marker = tiny_fp32.tokenizer.decode(generated[4:6])
    earliest = next(n for n in range(2, BUDGET + 1) if marker in tiny_fp32.tokenizer.decode(generated[:n]))
    # An added (normal) token spelling the marker: the tokenizer encodes it as that one token, while
    # the model (whose vocabulary ends before it) spells it with two.
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_folder)
    tokenizer.add_tokens([marker])
    assert tokenizer.encode(marker, add_special_tokens=False) == [len(tokenizer) - 1]
    live = build_live(tiny_fp32, PROMPT, StageBoundary(BUDGET, marker), frozenset(), tokenizer)
    assert live.reasoning.stop == "marker" and live.marker_match == "text"
    assert list(live.reasoning.tokens) == generated[:earliest]


def test_text_matching_decodes_a_tail_window_not_the_whole_stage(tiny_fp32, monkeypatch):
    decoded: list[int] = []
    spelled = constructions.text_of
    monkeypatch.setattr(
        constructions, "text_of", lambda tokenizer, tokens: decoded.append(len(tokens)) or spelled(tokenizer, tokens)
    )
    live = build_live(tiny_fp32, PROMPT, StageBoundary(BUDGET, "never said"), frozenset(), tiny_fp32.tokenizer)
    window = MarkerMatcher.for_tokenizer("never said", tiny_fp32.tokenizer).window
    assert live.reasoning.stop == "budget" and live.marker_match is None
    assert len(decoded) == BUDGET and max(decoded) == window < BUDGET


def test_text_matching_keeps_special_tokens(marker_loaded):
    """Text is matched on a decode that keeps special tokens: a marker inside one's text is seen."""
    loaded, step, _ = marker_loaded
    tokens = list(free_run(loaded).reasoning.tokens)[: step + 1]
    matcher = MarkerMatcher.for_tokenizer("/thi", loaded.tokenizer)
    assert matcher.match(tokens) == "text" and matcher.match(tokens[:-1]) is None


def test_the_ledger_records_which_marker_match_fired_and_rebuilt_rows_copy_it(marker_folder, marker_loaded, tmp_path):
    folder, step, _, _ = marker_folder
    record = tmp_path / "model.json"
    write_model_record(record, folder, "test")
    items = tmp_path / "items.jsonl"
    items.write_text(
        json.dumps({"id": "q1", "question": "1+1?", "choices": ["1", "2", "3", "4"], "answer": "B"}) + "\n"
    )
    prompts = write_table(
        [
            {
                "item_id": "q1",
                "prompt_tokens": PROMPT,
                "prompt_fingerprint": "-",
                "readout_cue_tokens": [1, 2],
                "readout_letter_tokens": [3, 4, 5, 6],
            }
        ],
        PROMPT_SCHEMA,
        tmp_path / "prompts.parquet",
    )
    spec = ShardSpec("tiny", "fp32", replica=0, shard=0, shard_size=1)
    runtime = Runtime(precision="fp32", device="cpu", threads=1)

    def context(out):
        return JobContext.read(
            record,
            runtime=runtime,
            shard_spec=spec,
            items_path=items,
            suffix_tokens=4,
            store_root=tmp_path / "objects",
            out_path=out,
            prompts_path=prompts,
        )

    live_path = run_live_shard(context(tmp_path / "live.parquet"), StageBoundary(BUDGET, MARKER))
    rebuilt_path = run_construction_shard(context(tmp_path / "prefill.parquet"), live_path, "prefill")
    (live,) = read_table(live_path, TRAJECTORY_SCHEMA).to_pylist()
    (rebuilt,) = read_table(rebuilt_path, TRAJECTORY_SCHEMA).to_pylist()
    assert TRAJECTORY_SCHEMA.names.index("marker_match") == TRAJECTORY_SCHEMA.names.index("boundary_reason") + 1
    assert TRAJECTORY_SCHEMA.field("marker_match").type == pa.string()
    assert (live["boundary_reason"], live["marker_match"]) == ("marker", "token_ids")
    assert live["prefix_length"] == len(PROMPT) + step + 1
    assert (rebuilt["construction"], rebuilt["boundary_reason"], rebuilt["marker_match"]) == (
        "prefill",
        "marker",
        "token_ids",
    )
    environment = marker_loaded[0].environment
    for row in (live, rebuilt):
        assert {name: row[name] for name in ENVIRONMENT_COLUMNS} == {
            name: getattr(environment, name) for name in ENVIRONMENT_COLUMNS
        }
