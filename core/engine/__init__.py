"""The built-in rollout engine: one process speaking SGLang's server API
(`python -m milepost.core.engine.server`). The fleet (core/fleet/) launches and drives it
over HTTP like SGLang; nothing here imports the fleet.
"""
