"""Pure-PyTorch references for every kernel in plugins/.

They define what each kernel must compute (tests compare against them) and are what the runtime runs on
CPU. They favour clarity over speed: fp32 math, explicit loops over sequences.
"""
