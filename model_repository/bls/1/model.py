"""Triton model: BLS version of the ensemble (decoupled unless built with serving.decoupled=false). Logic: backend/serving/text_models/bls.py."""
import triton_python_backend_utils as pb_utils

from backend.logs import route_to_triton
from backend.serving.text_models.bls import BlsHost
from backend.serving.engine_model.model_args import engine_dir, model_config, parameter
from backend.serving.conversion.transaction import is_decoupled, streaming_refused


class TritonPythonModel:
    def initialize(self, args):
        route_to_triton(pb_utils)  # kiln.* log lines go to the server's log
        cfg = model_config(args)
        self.name, self.decoupled = args["model_name"], is_decoupled(cfg)
        self.host = BlsHost(pb_utils, engine_dir(args, cfg), parameter(cfg, "engine_model"),
                            model_name=args["model_name"], instance=args["model_instance_name"],
                            decoupled=self.decoupled)

    def execute(self, requests):
        if not self.decoupled:  # one response per request: a streaming request is refused
            requests = [r for r in requests if not streaming_refused(pb_utils, r, self.name, "stream")]
        self.host.execute(requests)  # each request streams on a thread of its own
        return None

    def finalize(self):
        self.host.shutdown()
