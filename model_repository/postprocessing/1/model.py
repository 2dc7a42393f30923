"""Triton model: stateless detokenization of one engine response. Logic: backend/serving/text_models/postprocess.py."""
import triton_python_backend_utils as pb_utils

from backend.logs import get_logger, route_to_triton
from backend.serving.engine_model.model_args import engine_dir, model_config
from backend.serving.conversion.convert import InvalidRequest
from backend.serving.text_models.postprocess import POSTPROCESSING_INPUTS, postprocess_tensors
from backend.serving.conversion.tokenizer import load_tokenizer

_LOG = get_logger("serving.postprocessing")


class TritonPythonModel:
    def initialize(self, args):
        route_to_triton(pb_utils)  # kiln.* log lines go to the server's log
        self.tok = load_tokenizer(engine_dir(args, model_config(args)))

    def execute(self, requests):
        responses = []
        for request in requests:
            tensors = {n: t.as_numpy() for n in POSTPROCESSING_INPUTS
                       if (t := pb_utils.get_input_tensor_by_name(request, n)) is not None}
            try:
                out = postprocess_tensors(self.tok, tensors)
            except InvalidRequest as e:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
                continue
            except Exception as e:  # noqa: BLE001 - one bad response must not fail its batchmates
                _LOG.exception("request %s: postprocessing failed", request.request_id() or "-")
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(f"postprocessing: {type(e).__name__}: {e}")))
                continue
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()]))
        return responses
