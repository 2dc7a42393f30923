"""An OpenAI-compatible HTTP front door over a running Triton server.

    python -m harness.openai --triton-url 127.0.0.1:8001 \\
        --model-repository build/smollm2-135m-fp8/model_repository

It is a front door, not a second engine (docs: design.md): every generation is one gRPC stream to
the repository's engine model (``tensorrt_llm``), fed token ids the front door tokenized with the
bundle's own tokenizer, so usage counts are exact and prompts are checked against the engine's
limits before anything is sent. One module per job:

* ``served_model``   what is served: names, tokenizer, limits, read from the built repository
* ``errors``         OpenAI's error body and the status each kind of failure gets
* ``auth``, ``limits``  API keys on /v1; body size, JSON depth and max_tokens limits
* ``params``         request body -> checked sampling parameters (a mistake names its field)
* ``tools``, ``tool_*``  tool calling: request checks, syntax table and parsers, prompt, grammar, answer
* ``reasoning``, ``chat_answer``  the ``<think>`` split and one chat answer's reasoning, content, calls
* ``prompts``        chat messages / completion prompts -> token ids
* ``request_plan``   a body -> the checked engine call (shared by every generating route)
* ``engine_client``  the gRPC stream to the engine model, cancelled when the caller goes away
* ``responses``      OpenAI's response and stream-chunk objects
* ``streaming``      server-sent events and the disconnect watch
* ``responses_*``    the Responses API: input translation and store, output objects and events, route
* ``app``            the FastAPI routes, health and metrics
* ``__main__``       the command line
* ``process``        runs it as a child process beside Triton (``make serve``, tests, benchmarks)
"""
