"""milepost: RL post-training campaigns on HPC clusters."""
__version__ = "0.1.0"
