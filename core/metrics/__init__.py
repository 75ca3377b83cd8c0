"""Metrics beside blocks/<n>/metrics.jsonl: sinks (TensorBoard, MLflow) fed with committed
steps exactly once, and the campaign plot of `milepost status --plot`."""
