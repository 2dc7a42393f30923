"""Triton model: BLS version of the ensemble (decoupled). Logic: backend/serving/bls.py."""
import triton_python_backend_utils as pb_utils

from backend.logs import route_to_triton
from backend.serving.bls import BlsHost
from backend.serving.model_args import engine_dir, model_config, parameter


class TritonPythonModel:
    def initialize(self, args):
        route_to_triton(pb_utils)  # kiln.* log lines go to the server's log
        cfg = model_config(args)
        self.host = BlsHost(pb_utils, engine_dir(args, cfg), parameter(cfg, "engine_model"),
                            model_name=args["model_name"], instance=args["model_instance_name"])

    def execute(self, requests):
        self.host.execute(requests)  # each request streams on a thread of its own
        return None

    def finalize(self):
        self.host.shutdown()
