"""Talk to a Kiln model served by Triton.

    python -m harness.client "Tell me about Paris"                       # gRPC, ensemble, one response
    python -m harness.client --stream "Tell me about Paris"              # tokens printed as they arrive
    python -m harness.client --model bls --protocol http --stream "Hi"   # HTTP generate_stream (SSE)

Any Triton gRPC/HTTP client works the same way: the inputs are tensorrtllm_backend's names.
"""
from __future__ import annotations

import argparse
import sys

from harness.serving_client import GenerateError, grpc_generate, http_generate, http_stream

DEFAULT_URL = {"grpc": "127.0.0.1:8001", "http": "127.0.0.1:8000"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the text to send (text_input)")
    p.add_argument("--url", help="host:port (default 127.0.0.1:8001 for grpc, :8000 for http)")
    p.add_argument("--model", default="ensemble", help="ensemble | bls (or the configured serving.model_name)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    # On by default: the shipped engines are instruct/chat models, which ramble on a raw prompt.
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template to the prompt (default; --no-chat sends it raw)")
    p.add_argument("--echo", action="store_true", help="include the prompt in a non-streamed answer")
    a = p.parse_args(argv)
    if a.max_tokens < 1:
        p.error(f"--max-tokens: {a.max_tokens}; allowed: >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    url = a.url or DEFAULT_URL[a.protocol]
    params = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                  seed=a.seed, stop_words=a.stop, apply_chat_template=a.chat,
                  exclude_input_in_output=not a.echo, stream=a.stream)
    params = {k: v for k, v in params.items() if v is not None}
    out = sys.stdout
    try:
        if a.protocol == "http":
            if a.stream:
                for event in http_stream(url, a.model, a.prompt, **params):
                    out.write(event.get("text_output", ""))
                    out.flush()
            else:
                out.write(http_generate(url, a.model, a.prompt, **params)["text_output"])
        else:
            def show(piece: str) -> None:
                out.write(piece)
                out.flush()
            res = grpc_generate(url, a.model, a.prompt, on_piece=show, **params)
            if res.error:
                raise GenerateError(res.error)
        out.write("\n")
    except GenerateError as e:
        print(f"error from {url} ({a.model}): {e}", file=sys.stderr)
        return 1
    except (ConnectionError, OSError) as e:
        print(f"cannot reach {url}: {e} (is the server running? make serve)", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - tritonclient's connection errors have no common base
        print(f"error talking to {url}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
