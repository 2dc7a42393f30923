"""Kiln quantization: ModelOpt recipes and export (quantize.py, heavy, imported on demand) and the
pure-torch runtime weight formats (formats.py, pack.py). Importing this package imports nothing."""
