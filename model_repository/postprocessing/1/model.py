"""Triton model: stateless detokenization of one engine response. Logic: backend/serving/postprocess.py."""
import triton_python_backend_utils as pb_utils

from backend.serving.model_args import engine_dir, model_config
from backend.serving.postprocess import postprocess_tensors
from backend.serving.tokenizer import load_tokenizer

_INPUTS = ("output_ids", "context_ids", "text_trim", "echo_text", "output_log_probs", "acceptance_rate",
           "total_accepted_draft_tokens", "total_draft_tokens")


class TritonPythonModel:
    def initialize(self, args):
        self.tok = load_tokenizer(engine_dir(args, model_config(args)))

    def execute(self, requests):
        responses = []
        for request in requests:
            tensors = {n: t.as_numpy() for n in _INPUTS
                       if (t := pb_utils.get_input_tensor_by_name(request, n)) is not None}
            out = postprocess_tensors(self.tok, tensors)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()]))
        return responses
