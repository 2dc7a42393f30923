"""The engine model (NVIDIA's ``tensorrt_llm``) behind ``model_repository/engine/1/model.py``:
``engine_host.py`` hosts one executor per instance; requests in (``engine_request.py``), streams
and their responses out (``engine_stream.py``, ``engine_outputs.py``, ``responder.py``,
``row_group.py``), its serving state (``serving_state.py``), where it runs (``placement.py``), its
config.pbtxt parameters and run-time settings (``model_args.py``, ``settings.py``)."""
