"""NVIDIA inputs Kiln declares but cannot honour (backend/serving/conversion/neutral_inputs.py): the neutral
value passes, anything else is refused naming the input and the reason, and the rendered configs
declare exactly the table's inputs with its types."""
from __future__ import annotations

import numpy as np
import pytest

from backend.serving.conversion.convert import InvalidRequest
from backend.serving.conversion.neutral_inputs import ENGINE, NEUTRAL_INPUTS, TEXT, check_neutral, declarations

BY_NAME = {n.name: n for n in NEUTRAL_INPUTS}


@pytest.mark.parametrize("model, tensors", [
    (ENGINE, {"lora_weights": np.zeros((0, 8), np.float16), "lora_config": np.zeros((0, 3), np.int32),
              "prompt_embedding_table": np.zeros((0, 4), np.float16), "prompt_vocab_size": np.array([0], np.int32),
              "draft_input_ids": np.zeros(0, np.int32), "runtime_top_p_decay": np.array([1.0], np.float32),
              "runtime_top_p_min": np.array([0.3], np.float32), "len_penalty": np.array([0.7], np.float32),
              "early_stopping": np.array([True]), "lookahead_window_size": np.array([0], np.int32)}),
    (TEXT, {"num_draft_tokens": np.array([0], np.int32),
            "use_draft_logits": np.array([False]), "length_penalty": np.array([2.0], np.float32),
            "image_url_input": np.array([b""], dtype=object), "prompt_table_extra_id": np.array([0], np.uint64),
            "return_kv_cache_reuse_stats": np.array([False])}),
])
def test_neutral_values_pass(model, tensors):
    check_neutral(tensors, model)


@pytest.mark.parametrize("model, name, value, reason", [
    (ENGINE, "lora_task_id", np.array([0], np.uint64), "Kiln serves no LoRA adapters"),
    (TEXT, "lora_task_id", np.array([7], np.uint64), "Kiln serves no LoRA adapters"),
    (ENGINE, "lora_weights", np.ones((2, 8), np.float16), "LoRA"),
    (ENGINE, "prompt_embedding_table", np.ones((3, 4), np.float16), "prompt tables"),
    (TEXT, "prompt_vocab_size", np.array([3], np.int32), "prompt tables"),
    (ENGINE, "runtime_top_p_decay", np.array([0.9], np.float32), "top-p decay"),
    (ENGINE, "draft_input_ids", np.array([5, 6], np.int32), "EAGLE-3"),
    (TEXT, "num_draft_tokens", np.array([4], np.int32), "EAGLE-3"),
    (TEXT, "image_url_input", np.array([b"http://x/cat.png"], dtype=object), "text-only"),
    (ENGINE, "lookahead_ngram_size", np.array([3], np.int32), "lookahead"),
    (TEXT, "return_kv_cache_reuse_stats", np.array([True]), "return_perf_metrics"),
])
def test_anything_else_is_refused_with_the_reason(model, name, value, reason):
    with pytest.raises(InvalidRequest, match=f"input '{name}': .* is not supported \\(.*{reason}") as e:
        check_neutral({name: value}, model)
    assert f"allowed: {BY_NAME[name].allowed}" in str(e.value)


def test_only_the_models_inputs_are_checked():
    check_neutral({"length_penalty": np.array([3.0])}, ENGINE)      # a text-model name: not the engine's
    check_neutral({"draft_input_ids": np.array([1, 2])}, TEXT)      # an engine name: not the text models'


def test_rendered_configs_declare_the_table(tmp_path):
    from builder.config import ServingConfig
    from builder.stages.package import render_repository, template_values
    render_repository(template_values(ServingConfig(), "../engine"), tmp_path)
    engine = (tmp_path / "tensorrt_llm" / "config.pbtxt").read_text()
    for model, folder in ((ENGINE, "tensorrt_llm"), (TEXT, "ensemble"), (TEXT, "tensorrt_llm_bls"), (TEXT, "preprocessing")):
        text = (tmp_path / folder / "config.pbtxt").read_text()
        for n in NEUTRAL_INPUTS:
            line = f'{{ name: "{n.name}" data_type: {n.triton_type} dims: {n.dims} optional: true }}'
            assert (line in text) == (model in n.models), (folder, n.name)
    assert declarations(ENGINE).count("\n") == sum(ENGINE in n.models for n in NEUTRAL_INPUTS)
    ensemble = (tmp_path / "ensemble" / "config.pbtxt").read_text()
    assert 'input_map { key: "lora_task_id" value: "lora_task_id" }' in ensemble
    assert '"min_length"' in engine and '"return_num_output_tokens"' in engine
