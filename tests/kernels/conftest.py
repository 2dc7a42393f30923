"""Kernel tests run the real Triton kernels: on an NVIDIA GPU when there is one, otherwise on CPU tensors
through Triton's interpreter (TRITON_INTERPRET must be set before triton is first imported)."""
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("KILN_KERNEL_TESTS_ON_GPU") else "1")

import torch  # noqa: E402

NO_KERNEL_RUNNER = "TRITON_INTERPRET=0 and no GPU: nothing can run the kernels"


@pytest.fixture(scope="session")
def device() -> str:
    """Where kernels run: 'cuda' when the interpreter is off and a GPU exists, else 'cpu' (interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip(NO_KERNEL_RUNNER)  # only when the interpreter was turned off on a GPU-less host
    return "cuda"


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random inputs every run (the seed is printed on failure so a case can be replayed)."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    yield seed
