"""What every Triton model of Kiln shares: tensors to requests and back (``convert.py``,
``batching.py``, NVIDIA's inputs Kiln checks but does not act on in ``neutral_inputs.py``), the
tokenizer and incremental detokenization (``tokenizer.py``, ``detok.py``) and the transaction policy
(``transaction.py``). Imports nothing else from ``backend.serving``."""
