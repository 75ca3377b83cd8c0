"""Megatron-core train backend (train.backend: megatron). Heavy imports happen inside the modules."""
