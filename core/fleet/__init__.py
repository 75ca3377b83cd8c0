"""The rollout fleet: launching engines (built-in or SGLang) on Ray actors, supervising and
restarting them, the sglang-router in front, and the HTTP clients that talk to them.

It reaches engines only over HTTP and through their processes: nothing here imports the
built-in engine (core/engine/); facts both sides share are in core/engine_wire.py.
"""
