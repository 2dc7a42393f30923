"""end_to_end_test.py: preprocessing -> tensorrt_llm -> postprocessing by hand vs ensemble and bls.

Replays NVIDIA's tensorrtllm_backend client script request for request against the real Triton
server (shared prompts, expected answers and request building: tests/serving/nvidia_clients.py).
"""
from __future__ import annotations


import numpy as np
import pytest

from harness.model_names import DEFAULT as NAMES

from tests.serving.nvidia_clients import (ETE_N, ETE_PROMPT, protocol_client, client_module, one_text, tensor)

pytestmark = [pytest.mark.slow, pytest.mark.server]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_end_to_end_test_functionality(nd_server, refs, protocol):
    """end_to_end_test.py (test_functionality_ifb with --return-log-probs and --test-bls)."""
    mod = client_module(protocol)
    ref = refs.ete
    L = len(ref.prompt_ids)
    client = protocol_client(nd_server, protocol)
    try:
        # 1. preprocessing
        pre = client.infer("preprocessing", [
            tensor(mod, "QUERY", np.array([[ETE_PROMPT]]).astype(object)),
            tensor(mod, "BAD_WORDS_DICT", np.array([[""]]).astype(object)),
            tensor(mod, "STOP_WORDS_DICT", np.array([[""]]).astype(object)),
            tensor(mod, "REQUEST_OUTPUT_LEN", np.array([[ETE_N]], dtype=np.int32)),
        ], request_id="0")
        input_id = pre.as_numpy("INPUT_ID")
        request_input_len = pre.as_numpy("REQUEST_INPUT_LEN")
        request_output_len = pre.as_numpy("REQUEST_OUTPUT_LEN")
        decoder_input_id = pre.as_numpy("DECODER_INPUT_ID")
        end_id, pad_id = pre.as_numpy("OUT_END_ID"), pre.as_numpy("OUT_PAD_ID")
        assert input_id.dtype == np.int32 and input_id.tolist() == [ref.prompt_ids], input_id
        assert request_input_len.dtype == np.int32 and request_input_len.tolist() == [[L]]
        assert request_output_len.dtype == np.int32 and request_output_len.tolist() == [[ETE_N]]
        assert decoder_input_id.dtype == np.int32 and decoder_input_id.shape == (1, 1), decoder_input_id.shape
        # no END_ID sent: the tokenizer's end id (the contract; NVIDIA's preprocessing does the same)
        assert end_id.dtype == np.int32 and end_id.tolist() == [[refs.eos]], \
            f"OUT_END_ID {end_id.tolist()}, expected the tokenizer's end id [[{refs.eos}]]"
        assert pad_id.dtype == np.int32 and pad_id.shape == (1, 1), pad_id

        # 2. tensorrt_llm, no outputs named (all of them)
        eng = client.infer("tensorrt_llm", [
            tensor(mod, "input_ids", input_id),
            tensor(mod, "decoder_input_ids", decoder_input_id),
            tensor(mod, "input_lengths", request_input_len),
            tensor(mod, "request_output_len", request_output_len),
            tensor(mod, "end_id", end_id),
            tensor(mod, "pad_id", pad_id),
            tensor(mod, "return_log_probs", np.array([[True]], dtype=bool)),
        ], request_id="0")
        output_ids = eng.as_numpy("output_ids").astype(np.int32)
        sequence_length = eng.as_numpy("sequence_length")
        cum_log_probs = eng.as_numpy("cum_log_probs").astype(np.float32)
        output_log_probs = eng.as_numpy("output_log_probs").astype(np.float32)
        assert output_ids.shape == (1, 1, L + ETE_N) and sequence_length.tolist() == [[L + ETE_N]]
        assert output_ids[0, 0].tolist() == ref.prompt_ids + ref.ids
        assert cum_log_probs.shape == (1, 1) and output_log_probs.shape == (1, 1, ETE_N)
        np.testing.assert_allclose(output_log_probs[0, 0], ref.logprobs, rtol=1e-4, atol=1e-4)

        # 3. postprocessing
        post = client.infer("postprocessing", [
            tensor(mod, "TOKENS_BATCH", output_ids),
            tensor(mod, "SEQUENCE_LENGTH", sequence_length),
        ], request_id="0")
        output0 = post.as_numpy("OUTPUT")
        assert one_text(output0, "OUTPUT") == ref.full_text
        # NVIDIA's postprocessing also takes the engine's log-probs and row under upper-case names
        # and passes them through as OUT_*
        post = client.infer("postprocessing", [
            tensor(mod, "TOKENS_BATCH", output_ids), tensor(mod, "SEQUENCE_LENGTH", sequence_length),
            tensor(mod, "OUTPUT_LOG_PROBS", output_log_probs), tensor(mod, "CUM_LOG_PROBS", cum_log_probs),
            tensor(mod, "BATCH_INDEX", np.array([[0]], np.int32))])
        assert one_text(post.as_numpy("OUTPUT"), "OUTPUT") == ref.full_text
        assert (post.as_numpy("OUT_OUTPUT_LOG_PROBS") == output_log_probs).all()
        assert (post.as_numpy("OUT_CUM_LOG_PROBS") == cum_log_probs).all()
        assert post.as_numpy("OUT_BATCH_INDEX").tolist() == [[0]]

        # 4. ensemble, 5. tensorrt_llm_bls (--test-bls): the same inputs and requested outputs
        text_inputs = [
            tensor(mod, "text_input", np.array([[ETE_PROMPT]]).astype(object)),
            tensor(mod, "max_tokens", np.array([[ETE_N]], dtype=np.int32)),
            tensor(mod, "bad_words", np.array([[""]]).astype(object)),
            tensor(mod, "stop_words", np.array([[""]]).astype(object)),
            tensor(mod, "return_log_probs", np.array([[True]], dtype=bool)),
        ]
        for model in (NAMES.ensemble, NAMES.bls):
            outputs = [mod.InferRequestedOutput(n) for n in ("text_output", "cum_log_probs", "output_log_probs")]
            res = client.infer(model, text_inputs, outputs=outputs, request_id="0")
            text_output = res.as_numpy("text_output")
            assert text_output.shape == output0.shape, (model, text_output.shape, output0.shape)
            assert (output0 == text_output).all(), (model, output0, text_output)  # the script's assert
            assert one_text(text_output) == ref.full_text
            ens_cum = res.as_numpy("cum_log_probs")
            ens_olp = res.as_numpy("output_log_probs")
            assert ens_cum.shape == cum_log_probs.shape and (cum_log_probs == ens_cum).all(), \
                (model, cum_log_probs, ens_cum)
            assert ens_olp.shape == output_log_probs.shape and (output_log_probs == ens_olp).all(), \
                (model, output_log_probs, ens_olp)
    finally:
        client.close()


