"""Triton model: the Kiln engine (decoupled unless built with serving.decoupled=false).
Logic: backend/serving/engine_model/engine_host.py; its device: backend/serving/engine_model/placement.py."""
import triton_python_backend_utils as pb_utils

from backend.logs import route_to_triton
from backend.serving.engine_model.engine_host import EngineHost
from backend.serving.engine_model.model_args import engine_dir, exit_stub, instance_count, instance_placement, model_config
from backend.serving.engine_model.settings import ServingSettings
from backend.serving.conversion.transaction import is_decoupled, streaming_refused


class TritonPythonModel:
    def initialize(self, args):
        route_to_triton(pb_utils)  # kiln.* log lines go to the server's log
        cfg = model_config(args)
        self.name, self.decoupled = args["model_name"], is_decoupled(cfg)
        bundle = engine_dir(args, cfg)
        # KIND_GPU: cuda:<the instance's first GPU> (its tensor-parallel ranks take the next ones);
        # refuses here, before loading, when fewer GPUs are visible than tp_size x instances
        place = instance_placement(args, cfg, bundle)
        self.host = EngineHost(pb_utils, bundle, device=place.device, settings=ServingSettings.from_parameters(cfg),
                               model_name=args["model_name"], instance=args["model_instance_name"],
                               # nv_trt_llm_*: NVIDIA's labels, plus the instance when several run
                               version=str(args["model_version"]),
                               nv_instance=args["model_instance_name"] if instance_count(cfg) > 1 else None,
                               on_fatal=exit_stub, decoupled=self.decoupled)

    def execute(self, requests):
        if not self.decoupled:  # one response per request: a streaming request is refused
            requests = [r for r in requests if not streaming_refused(pb_utils, r, self.name, "streaming")]
        self.host.execute(requests)  # only enqueues; responses come from the executor thread
        return None

    def finalize(self):
        self.host.shutdown()
