"""Talk to a Kiln model served by Triton.

    python -m harness.client "Tell me about Paris"                       # gRPC, ensemble, one response
    python -m harness.client --stream "Tell me about Paris"              # tokens printed as they arrive
    python -m harness.client --model tensorrt_llm_bls --protocol http --stream "Hi"   # HTTP generate_stream (SSE)
    python -m harness.client --json "Tell me about Paris"                # one JSON object, with the
                                                                         # speculative-decoding figures
    python -m harness.client --config configs/smollm2-135m-fp8.yaml "Hi"  # that config's serving ports

A Triton that requires an API key (``harness.serve --triton-host`` beyond loopback, with keys) is sent
the first of ``--api-key``, ``--api-key-file`` and ``KILN_API_KEY``: ``Authorization: Bearer KEY`` over
HTTP, ``triton-grpc-protocol-authorization: Bearer KEY`` over gRPC (harness/triton_auth.py).

Any Triton gRPC/HTTP client works the same way: the inputs are tensorrtllm_backend's names. The
client asks for the acceptance figures (``return_perf_metrics``); when the engine speculated
(an EAGLE-3 draft in the bundle) a summary line goes to stderr, and ``--json`` includes them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any, Callable

import numpy as np

from backend.serving.metrics.acceptance import read_acceptance
from builder.schema import ConfigError
from harness.serving_client import GenerateError, grpc_inputs, http_generate, http_stream
from harness.model_names import DEFAULT
from harness.serve_ports import DEFAULT as DEFAULT_PORTS, Ports, config_ports
from harness.triton_auth import client_key, grpc_headers, http_headers


def default_url(protocol: str, ports: Ports = DEFAULT_PORTS) -> str:
    """127.0.0.1 on the served config's gRPC or HTTP port."""
    return f"127.0.0.1:{ports.grpc if protocol == 'grpc' else ports.http}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the text to send (text_input)")
    p.add_argument("--url", help="host:port (default 127.0.0.1 on --config's serving.grpc_port / "
                                 f"serving.http_port, else :{DEFAULT_PORTS.grpc} for grpc, :{DEFAULT_PORTS.http} for http)")
    p.add_argument("--config", default=None,
                   help="the engine config being served: its serving ports make the default --url")
    p.add_argument("--model", default=DEFAULT.ensemble,
                   help=f"{DEFAULT.ensemble} | {DEFAULT.bls} (or the names set in serving.model_names)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop word (repeatable): tokenized, matched on the generated tokens, kept in the output (NVIDIA's stop_words)")
    # On by default: the shipped engines are instruct/chat models, which ramble on a raw prompt.
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template to the prompt (default; --no-chat sends it raw)")
    p.add_argument("--echo", action="store_true", help="include the prompt in a non-streamed answer")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="the API key of a Triton that requires one (default: the first of --api-key-file, else "
                        "of KILN_API_KEY); visible to other users in ps: prefer the file or the environment")
    p.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                   help="a file of API keys, one per line (# comments): its first is sent")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text plus acceptance_rate, total_accepted_draft_tokens, "
                        "total_draft_tokens (instead of the plain text)")
    a = p.parse_args(argv)
    if a.max_tokens < 1:
        p.error(f"--max-tokens: {a.max_tokens}; allowed: >= 1")
    if a.url is None:
        try:
            a.url = default_url(a.protocol, config_ports(a.config))
        except (ConfigError, ValueError) as e:
            p.error(str(e))
    try:
        a.key = client_key(a.api_key, a.api_key_file)
    except (OSError, ValueError) as e:
        p.error(str(e))
    del a.api_key  # only the resolved key travels on
    return a


def _tensors(result: Any, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {n: v for n in names if (v := result.as_numpy(n)) is not None}


def declares_perf_metrics(url: str, model: str, protocol: str, key: str | None = None) -> bool:
    """Whether the model takes ``return_perf_metrics`` (a repository rendered before it existed
    does not, and Triton refuses an input a model does not declare)."""
    if protocol == "http":
        import tritonclient.http as th
        client = th.InferenceServerClient(url)
        try:
            names = [i["name"] for i in client.get_model_metadata(model, headers=http_headers(key))["inputs"]]
        finally:
            client.close()
    else:
        import tritonclient.grpc as tg
        client = tg.InferenceServerClient(url)
        try:
            names = [i.name for i in client.get_model_metadata(model, headers=grpc_headers(key)).inputs]
        finally:
            client.close()
    return "return_perf_metrics" in names


def grpc_run(url: str, model: str, text: str, on_piece: Callable[[str], None] | None,
             key: str | None = None, **params: Any) -> tuple[str, dict | None]:
    """One request over a gRPC stream: (the whole text, the last acceptance figures or None)."""
    import tritonclient.grpc.aio as aio
    from backend.serving.metrics.acceptance import ACCEPTANCE_OUTPUTS

    if "return_perf_metrics" in params:  # not in serving_client's table of typed inputs
        params["return_perf_metrics"] = np.array([[bool(params["return_perf_metrics"])]])
    inputs = grpc_inputs(text, datatypes={"return_perf_metrics": "BOOL"}, **params)

    async def run() -> tuple[str, dict | None]:
        client = aio.InferenceServerClient(url)
        pieces: list[str] = []
        figures = None

        async def requests():
            yield {"model_name": model, "inputs": inputs}
        try:
            async for result, error in client.stream_infer(requests(), headers=grpc_headers(key) or None):
                if error is not None:
                    raise GenerateError(str(error))
                piece = result.as_numpy("text_output")
                if piece is not None and piece.size:
                    s = piece.reshape(-1)[0].decode("utf-8")
                    pieces.append(s)
                    if on_piece is not None and s:
                        on_piece(s)
                # cumulative on every response: the last one seen has the request's totals
                figures = read_acceptance(_tensors(result, ACCEPTANCE_OUTPUTS)) or figures
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    continue  # the server ends the stream next (harness.serving_client READ_TO_THE_END)
        finally:
            await client.close()
        return "".join(pieces), figures
    return asyncio.run(run())


def http_run(url: str, model: str, text: str, on_piece: Callable[[str], None] | None,
             key: str | None = None, **params: Any) -> tuple[str, dict | None]:
    """One request over HTTP generate or generate_stream (``stream``): (text, figures or None)."""
    if not params.get("stream"):
        body = http_generate(url, model, text, headers=http_headers(key), **params)
        return body["text_output"], read_acceptance(body)
    pieces, figures = [], None
    for event in http_stream(url, model, text, headers=http_headers(key), **params):
        s = event.get("text_output", "")
        pieces.append(s)
        if on_piece is not None and s:
            on_piece(s)
        figures = read_acceptance(event) or figures
    return "".join(pieces), figures


def summary(figures: dict | None) -> str | None:
    """The stderr line shown when the engine speculated; None when it did not."""
    if not figures or not figures["total_draft_tokens"]:
        return None
    return (f"[speculative decoding: {figures['total_accepted_draft_tokens']} of "
            f"{figures['total_draft_tokens']} draft tokens accepted "
            f"(acceptance rate {figures['acceptance_rate']:.2f})]")


def _key_hint(message: str, key: str | None) -> str:
    """What to do about Triton's refusal of a call without (or with the wrong) key."""
    if "restricted" not in message:
        return ""
    return (" (not the key the server requires: Triton takes the first of the keys it was given)" if key else
            " (the server requires an API key: --api-key-file FILE or KILN_API_KEY)")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    url = a.url
    params = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                  seed=a.seed, stop_words=a.stop, apply_chat_template=a.chat,
                  exclude_input_in_output=not a.echo, stream=a.stream)
    params = {k: v for k, v in params.items() if v is not None}
    out = sys.stdout

    def show(piece: str) -> None:
        out.write(piece)
        out.flush()
    on_piece = None if a.json else show
    try:
        if declares_perf_metrics(url, a.model, a.protocol, a.key):
            params["return_perf_metrics"] = True
        if a.protocol == "http":
            text, figures = http_run(url, a.model, a.prompt, on_piece, a.key, **params)
            if on_piece is not None and not a.stream:
                show(text)
        else:
            text, figures = grpc_run(url, a.model, a.prompt, on_piece, a.key, **params)
        if a.json:
            doc = {"model": a.model, "text": text, **(figures or {})}
            out.write(json.dumps(doc, ensure_ascii=False))
        out.write("\n")
        line = summary(figures)
        if line and not a.json:
            print(line, file=sys.stderr)
    except GenerateError as e:
        print(f"error from {url} ({a.model}): {e}{_key_hint(str(e), a.key)}", file=sys.stderr)
        return 1
    except (ConnectionError, OSError) as e:
        print(f"cannot reach {url}: {e} (is the server running? make serve)", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - tritonclient's connection errors have no common base
        print(f"error talking to {url}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
              f"{_key_hint(str(e), a.key)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
