"""The CI-sized EAGLE-3 bundle shared by the end-to-end tests: the real SmolLM2 target and a draft
really trained by ModelOpt, briefly (24 steps on the answers to 9 prompts), so it is built in
well under a minute and cached in build/test-cache/ like every other test bundle."""
import json
import os

import pytest

TRAIN_TEXTS = ["Explain how rain forms.", "Write a short poem about trees.", "What is a computer?",
               "How do birds fly?", "Give three tips for studying.", "What is the moon made of?",
               "Describe your favourite food.", "Why is exercise healthy?",
               # A one-word answer ends (EOS) long before seq_len: training batches then hold
               # sequences of different lengths, which ModelOpt's cached TTT masks must survive.
               "Answer with one word only: what colour is a clear daytime sky?"]


def eagle_overrides(verify: bool) -> list[str]:
    """Build overrides of the CI-sized draft. ``verify`` only changes the verify section, which is
    not part of the bundle's hash: both variants share one build folder, draft and bundle."""
    from tests.conftest import CACHE  # noqa: PLC0415 - the shared cache folder

    data = CACHE / "eagle-train-prompts.jsonl"
    text = "".join(json.dumps({"text": t}) + "\n" for t in TRAIN_TEXTS)
    if not data.is_file() or data.read_text() != text:   # unchanged file => cached draft stage
        data.parent.mkdir(parents=True, exist_ok=True)
        tmp = data.with_name(f".{data.name}.{os.getpid()}")   # whole or absent: workers read it while
        tmp.write_text(text)                                 # another one writes
        os.replace(tmp, data)
    # min_draft_prob 0: a draft trained this briefly is rarely confident, and the tests need drafts.
    # cpu_dtype pinned: the serving tests compare the server's output with an executor of their own
    # process, which under auto could each choose another dtype by timing at load.
    out = ["speculative.train.steps=24", "speculative.train.seq_len=64", f"speculative.train.dataset={data}",
           "speculative.min_draft_prob=0", "engine.cpu_dtype=float32"]
    return out + (["verify.num_prompts=2"] if verify else ["verify.enabled=false"])


@pytest.fixture(scope="session")
def eagle_bundle(build_bundle):
    return build_bundle("smollm2-135m-bf16-eagle3", eagle_overrides(verify=False))
