"""Low-precision number formats as pure tensor functions: group-wise INT4 (int4.py) and
block-wise FP8 (fp8.py); which precision mode runs where (modes.py)."""
