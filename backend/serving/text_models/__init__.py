"""The text models around the engine: tokenization and request checks (``preprocess.py``),
detokenization (``postprocess.py``) and the BLS model that chains them with the engine in one
Triton model (``bls.py``)."""
