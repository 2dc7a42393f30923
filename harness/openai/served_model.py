"""What the front door serves, read once from a built model repository (nothing from Triton).

The repository's engine model names its bundle (``engine_dir`` in its config.pbtxt); from the bundle
come the tokenizer (so prompts are tokenized here, exactly as the engine counts them) and the limits
a request is checked against before it is sent (engine.json's ``max_input_len``, ``max_seq_len``).
Reading files only means the front door starts, and answers 503, while Triton is still loading.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from backend import bundle
from backend.serving.conversion.tokenizer import TextTokenizer, load_tokenizer
from harness.model_names import repository_names
from harness.openai.reasoning import ReasoningFormat, choose_reasoning
from harness.openai.tool_parsers import ToolFormat, choose_format

__all__ = ["ServedModel", "load_served_model", "engine_dir_of", "markers_are_special"]

_ENGINE_DIR = re.compile(r'key:\s*"engine_dir"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


@dataclasses.dataclass(frozen=True)
class ServedModel:
    name: str               # the OpenAI model id clients send
    engine_model: str       # the Triton model the requests go to (NVIDIA's "tensorrt_llm")
    engine_dir: Path
    tokenizer: TextTokenizer
    max_input_len: int      # prompt tokens the engine accepts
    max_seq_len: int        # prompt + generated tokens
    vocab_size: int
    created: int            # engine.json's modification time: a stable "created" for /v1/models
    # how tool calls are written and parsed (--tool-parser; auto: from the chat template); None: no tools
    tool_format: ToolFormat | None = None
    # how the model's thinking is split from its answer (--reasoning-parser; auto: from the chat
    # template); None: it does not think, no reasoning_content
    reasoning: ReasoningFormat | None = None
    # the rows' markers include special tokens of this vocabulary ([TOOL_CALLS] in Mistral's,
    # <|channel|> in gpt-oss's): chat answers are then decoded with special tokens kept, or the
    # parsers would never see them
    markers_are_special: bool = False


def markers_are_special(tok: TextTokenizer, rows: list) -> bool:
    """Whether a special token of ``tok`` is spelled in one of the rows' markers."""
    texts = [s for row in rows if row is not None for s in row.markers() if s]
    special = {t.content for t in tok.tokenizer.get_added_tokens_decoder().values() if t.special and t.content}
    return any(m in s for s in texts for m in special)


def engine_dir_of(repo: Path, engine_model: str) -> Path:
    """The bundle the engine model loads: its ``engine_dir`` parameter, a relative one taken from the
    repository's root as the engine model itself does (backend/serving/engine_model/model_args.py)."""
    cfg = repo / engine_model / "config.pbtxt"
    if not cfg.is_file():
        raise FileNotFoundError(f"{cfg}: no engine model '{engine_model}' in {repo}; build it with: make build")
    m = _ENGINE_DIR.search(cfg.read_text(encoding="utf-8"))
    if not m:
        raise ValueError(f"{cfg}: no engine_dir parameter; is this a Kiln repository? rebuild with: make build")
    path = Path(m.group(1))
    return path if path.is_absolute() else (repo / path).resolve()


def bundle_parsers(repo: Path, engine_model: str) -> tuple[str, str]:
    """The build config's ``serving.tool_parser`` / ``reasoning_parser``, as the package stage wrote
    them into the engine model's config.pbtxt ("auto" for a repository built before they existed)."""
    text = (repo / engine_model / "config.pbtxt").read_text(encoding="utf-8")

    def param(key: str) -> str:
        m = re.search(r'key:\s*"' + key + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
        return m.group(1) if m and m.group(1) else "auto"
    return param("tool_parser"), param("reasoning_parser")


def load_served_model(repo: str | Path, name: str | None = None, tool_parser: str | None = None,
                      reasoning_parser: str | None = None, chat_template: str | None = None) -> ServedModel:
    """``name`` overrides the model id; by default it is the config's stem (``smollm2-135m-fp8``),
    which names the bundle wherever its build folder was moved. ``tool_parser`` / ``reasoning_parser``:
    None takes the bundle's (its build config's ``serving.*_parser``). ``chat_template``: a Jinja template
    that replaces the bundle's (``--chat-template``, as vLLM's: a checkpoint whose template lacks
    tools or thinking, or a fixed one), the parsers then chosen from it."""
    repo = Path(repo).resolve()
    if not repo.is_dir():
        raise FileNotFoundError(f"{repo}: model repository not found; build it with: make build")
    engine_model = repository_names(repo).engine
    edir = engine_dir_of(repo, engine_model)
    manifest = bundle.read(edir)
    if not name:
        name = Path(manifest.config_file).stem if manifest.config_file else repo.parent.name
    tok = load_tokenizer(edir)
    if chat_template is not None:
        tok = TextTokenizer(tok.tokenizer, chat_template, tok.special)
    built_tools, built_reasoning = bundle_parsers(repo, engine_model)
    tool_format = choose_format(tool_parser or built_tools, tok.chat_template)
    reasoning = choose_reasoning(reasoning_parser or built_reasoning, tok.chat_template)
    return ServedModel(name=name, engine_model=engine_model, engine_dir=edir, tokenizer=tok,
                       max_input_len=manifest.engine.max_input_len, max_seq_len=manifest.engine.max_seq_len,
                       vocab_size=tok.vocab_size, created=int((edir / bundle.MANIFEST).stat().st_mtime),
                       tool_format=tool_format, reasoning=reasoning,
                       markers_are_special=markers_are_special(tok, [tool_format, reasoning]))
