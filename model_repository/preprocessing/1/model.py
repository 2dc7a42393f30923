"""Triton model: tokenization and request validation. Logic: backend/serving/text_models/preprocess.py."""
import triton_python_backend_utils as pb_utils

from backend.logs import get_logger, route_to_triton
from backend.serving.conversion.batching import rows
from backend.serving.conversion.convert import InvalidRequest
from backend.serving.metrics.metrics import RequestErrors
from backend.serving.engine_model.model_args import engine_dir, model_config
from backend.serving.text_models.preprocess import PREPROCESSING_INPUTS, Preprocessor, preprocessing_outputs

_LOG = get_logger("serving.preprocessing")


class TritonPythonModel:
    def initialize(self, args):
        route_to_triton(pb_utils)  # kiln.* log lines go to the server's log
        self.pre = Preprocessor(engine_dir(args, model_config(args)))
        self.name = args["model_name"]
        self.errors = RequestErrors(pb_utils, self.name, args["model_instance_name"])

    def execute(self, requests):
        responses = []
        for request in requests:
            tensors = {n: t.as_numpy() for n in PREPROCESSING_INPUTS
                       if (t := pb_utils.get_input_tensor_by_name(request, n)) is not None}
            try:
                # one row per sequence (NVIDIA's --batch-inputs sends several); the engine splits them again
                out = preprocessing_outputs(*(self.pre.prepare_nvidia(r) for r in rows(tensors, self.name)))
            except InvalidRequest as e:
                self.errors.count("invalid_request")
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
                continue
            except Exception as e:  # noqa: BLE001 - one bad request must not fail its batchmates
                _LOG.exception("request %s: preprocessing failed", request.request_id() or "-")
                self.errors.count("internal")
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(f"preprocessing: {type(e).__name__}: {e}")))
                continue
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()]))
        return responses

    def finalize(self):
        self.errors.close()  # now, not while the stub's interpreter shuts down (segfaults there)
